"""gl.HFDataset: Hugging Face datasets read in place, proved against `datasets` itself (in the
peers' environment) and through every loader feature on folders laid out as `save_to_disk` does."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from peers import run_peer

import globalloader as gl
from helpers import Server, check_resume, every_arrow_type, same, strictly_equal

SRC = str(pathlib.Path(gl.__file__).parent.parent)

# -- a folder as save_to_disk writes it (for the tests that need no peer) -----------------------


def save_like_datasets(folder: pathlib.Path, table: pa.Table, features: dict[str, Any], shards: int, rows: int) -> None:
    """`table` in `shards` Arrow stream files of record batches of `rows`, with state.json and
    dataset_info.json: the layout `Dataset.save_to_disk` writes."""
    folder.mkdir(parents=True)
    names = []
    for s, part in enumerate(np.array_split(np.arange(table.num_rows), shards)):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.slice(int(part[0]), len(part)).to_batches(max_chunksize=rows):
                writer.write_batch(batch)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "x", "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))


@pytest.fixture
def folder(tmp_path: pathlib.Path) -> pathlib.Path:
    n = 230
    table = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "text": pa.array([f"row {i}" if i % 7 else None for i in range(n)]),
            "label": pa.array([i % 3 for i in range(n)], pa.int64()),
            "image": pa.array(
                [{"bytes": b"jpeg-%d" % i, "path": None} for i in range(n)],
                pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            ),
        }
    )
    features = {
        "id": {"dtype": "int64", "_type": "Value"},
        "text": {"dtype": "string", "_type": "Value"},
        "label": {"names": ["a", "b", "c"], "_type": "ClassLabel"},
        "image": {"_type": "Image"},
    }
    save_like_datasets(tmp_path / "ds", table, features, shards=3, rows=16)
    return tmp_path / "ds"


# -- against datasets itself --------------------------------------------------------------------

BUILD = """
import io, datasets, numpy as np
from PIL import Image as PImage
def jpeg(i):
    out = io.BytesIO()
    PImage.new("RGB", (8 + i % 5, 6), (i % 256, 10, 200)).save(out, format="JPEG")
    return out.getvalue()
n = INPUTS["n"]
features = datasets.Features({
    "i": datasets.Value("int64"), "f": datasets.Value("float32"), "s": datasets.Value("string"),
    "maybe": datasets.Value("int32"), "seq": datasets.Sequence(datasets.Value("float32")),
    "fixed": datasets.Sequence(datasets.Value("int16"), length=3),
    "nested": {
        "a": datasets.Value("int64"), "b": datasets.Value("string"), "c": datasets.Sequence(datasets.Value("int8"))
    },
    "grid": datasets.Array2D(shape=(2, 3), dtype="float32"),
    "rows": datasets.Array2D(shape=(None, 3), dtype="int32"),
    "label": datasets.ClassLabel(names=["cat", "dog", "bird"]),
    "image": datasets.Image(),
})
data = {
    "i": list(range(n)), "f": [i / 3 for i in range(n)], "s": [f"s{i}é" if i % 3 else None for i in range(n)],
    "maybe": [None if i % 4 == 0 else i for i in range(n)],
    "seq": [[float(j) for j in range(i % 4)] for i in range(n)],
    "fixed": [[i, -i, 7] for i in range(n)],
    "nested": [{"a": i, "b": str(i), "c": [i % 5] * (i % 3)} for i in range(n)],
    "grid": [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(n)],
    "rows": [np.arange(3 * (i % 3 + 1), dtype=np.int32).reshape(-1, 3) + i for i in range(n)],
    "label": [i % 3 for i in range(n)], "image": [{"bytes": jpeg(i), "path": None} for i in range(n)],
}
ds = datasets.Dataset.from_dict(data, features=features)
ds.save_to_disk("saved", num_shards=2)  # images: record batches of 100 rows, so 100 + 20 per file
datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk("splits")
read = datasets.load_from_disk("saved").cast_column("image", datasets.Image(decode=False))
OUTPUT = [dict(row) for row in read]
"""


def _as_datasets_gives(record: dict[str, Any], maybe_nulls: set[str]) -> dict[str, Any]:
    """Our record in the form `datasets` returns it (python format): arrays as lists, images as
    {bytes, path}, NaN for a null of an integer column as None."""
    out: dict[str, Any] = {}
    for name, value in record.items():
        if name == "__key__":
            continue
        if name in maybe_nulls and value != value:
            value = None
        elif name in maybe_nulls:
            value = int(value)
        out[name] = value.tolist() if isinstance(value, np.ndarray) else value
    out["image"] = {"bytes": record["image"], "path": None}
    return out


@pytest.mark.slow
def test_every_record_is_the_one_datasets_reads_folder_and_object(tmp_path: pathlib.Path) -> None:
    n = 240
    expected = run_peer(BUILD, tmp_path, n=n)
    src = gl.HFDataset(str(tmp_path / "saved"))
    assert len(src) == n and len(src.files) == 2 and src.block_starts.tolist() == [0, 100, 120, 220]
    assert src.int_columns_as_float == frozenset({"maybe"})
    records = [src[i] for i in range(n)]
    for record, theirs in zip(records, expected, strict=True):
        assert same(_as_datasets_gives(record, {"maybe"}), theirs), record["__key__"]
    first = records[1]
    assert first["grid"].shape == (2, 3) and first["grid"].dtype == np.float32
    assert first["rows"].shape == (2, 3) and first["rows"].dtype == np.int32
    assert isinstance(first["seq"], np.ndarray) and isinstance(first["label"], int)
    assert first["image"].startswith(b"\xff\xd8")  # the JPEG's own bytes, for the fast decode path
    # columns=: only those, the same values; and batches gathered by column equal collated records
    part = gl.HFDataset(str(tmp_path / "saved"), columns=["label", "image", "s"])
    assert part.columnar and list(part[5]) == ["__key__", "label", "image", "s"]
    assert same({k: part[5][k] for k in ("label", "image", "s")}, {k: records[5][k] for k in ("label", "image", "s")})
    idx = np.array([239, 0, 101, 100, 5])
    assert same(part.read_columns(idx), gl.Dataset(part).select(idx.tolist()).batch(5).iterator(0).__next__())
    # a DatasetDict folder names its splits
    with pytest.raises(gl.errors.ArgumentError, match=r"splits \['train', 'test'\].*train"):
        gl.HFDataset(str(tmp_path / "splits"))
    # the object form, in the peers' environment (the only one with datasets): the same records;
    # a shuffled dataset (an index mapping) is refused with what to call
    check_object = f"""
import sys, datasets, numpy as np
sys.path.insert(0, {SRC!r})
from globalloader.sources.hf import HFDataset
from globalloader.errors import ArgumentError
ds = datasets.load_from_disk("saved")
src = HFDataset(ds)
by_folder = HFDataset("saved")
same = all(
    repr(sorted((k, v.tolist() if isinstance(v, np.ndarray) else v) for k, v in src[i].items()))
    == repr(sorted((k, v.tolist() if isinstance(v, np.ndarray) else v) for k, v in by_folder[i].items()))
    for i in range(len(src))
)
refused = []
for changed in (
    ds.shuffle(seed=0), ds.select(range(5)), ds.rename_column("i", "j"), ds.cast_column("f", datasets.Value("float64"))
):
    try:
        HFDataset(changed)
        refused.append("")
    except ArgumentError as exc:
        refused.append(str(exc))
OUTPUT = (len(src), src.fingerprint == by_folder.fingerprint, same, refused)
"""
    count, same_fingerprint, same_records, refused = run_peer(check_object, tmp_path)
    assert (count, same_fingerprint, same_records) == (n, True, True)
    shuffled, selected, renamed, cast = refused
    assert "flatten_indices()" in shuffled and "flatten_indices()" in selected
    assert "save_to_disk it" in renamed  # a rename is held in memory, over files with the old name
    assert cast == ""  # cast_column writes a new cache file: read as it is


# -- loader features ------------------------------------------------------------------------------


def test_records_columns_and_a_window_shuffle_through_two_workers(folder: pathlib.Path) -> None:
    src = gl.HFDataset(folder)
    assert len(src) == 230 and src.block_starts.tolist()[:3] == [0, 16, 32]
    record = src[100]
    assert record["__key__"] == f"{folder / 'data-00001-of-00003.arrow'}:23"
    assert (record["id"], record["text"], record["label"], record["image"]) == (100, "row 100", 1, b"jpeg-100")
    assert src[7]["text"] is None
    ds = gl.Dataset(src).shuffle(seed=3, window=2).batch(16)
    in_thread = np.concatenate([b["id"] for b in ds.iterator(2)])
    with gl.Loader(ds, workers=2) as loader:
        loader.set_epoch(2)
        batches = list(loader)
    in_workers = np.concatenate([b["id"] for b in batches])
    assert np.array_equal(in_thread, in_workers) and sorted(in_workers.tolist()) == list(range(230))
    assert not np.array_equal(in_workers, np.arange(230))
    assert all(img == b"jpeg-%d" % i for b in batches for img, i in zip(b["image"], b["id"].tolist(), strict=True))
    with pytest.raises(gl.errors.ArgumentError, match=r"no column\(s\) \['nope'\].*\['id', 'text', 'label', 'image'\]"):
        gl.HFDataset(folder, columns=["id", "nope"])


def test_values_are_parquets_for_every_arrow_type(tmp_path: pathlib.Path) -> None:
    """One rule for every Arrow source: the same table read as an HF folder and as Parquet gives
    the same records (keys apart) and the same gathered batches."""
    table = every_arrow_type(90)
    save_like_datasets(tmp_path / "ds", table, {name: {"_type": "Value"} for name in table.column_names}, 2, 16)
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=16)
    hf, parquet = gl.HFDataset(tmp_path / "ds"), gl.Parquet(str(tmp_path / "t.parquet"))
    assert hf.int_columns_as_float == parquet.int_columns_as_float
    for i in (0, 3, 11, 30, 50, 77, 89, 45):
        ours, theirs = hf[i], parquet[i]
        assert ours.pop("__key__") != theirs.pop("__key__")
        assert strictly_equal(ours, theirs), [k for k in ours if not strictly_equal(ours[k], theirs[k])]
    plain = ["id", "f32", "int_with_null", "flag_with_null", "text", "blob"]
    hf, parquet = gl.HFDataset(tmp_path / "ds", columns=plain), gl.Parquet(str(tmp_path / "t.parquet"), columns=plain)
    idx = np.array([89, 3, 50, 44, 45, 0])
    ours, theirs = hf.read_columns(idx), parquet.read_columns(idx)
    assert hf.columnar and ours.pop("__key__") != theirs.pop("__key__") and strictly_equal(ours, theirs)


def test_an_elastic_resume_sees_every_row_once(folder: pathlib.Path) -> None:
    src = gl.HFDataset(folder, columns=["id"])

    def chain(rank: int, world: int) -> gl.Dataset:
        return gl.Dataset(src).shuffle(seed=0, window=2).shard(rank, world).batch(10)

    old = [chain(rank, 2).iterator() for rank in range(2)]
    seen = [int(i) for it in old for _ in range(4) for i in next(it)["id"]]
    state = old[0].state_dict()
    for rank in range(3):
        new = chain(rank, 3).iterator()
        new.load_state_dict(state)
        seen += [int(i) for batch in new for i in batch["id"]]
    assert sorted(seen) == list(range(230))


def test_shuffle_shard_and_resume_through_the_loader_equal_the_uninterrupted_run(folder: pathlib.Path) -> None:
    src = gl.HFDataset(folder, columns=["id", "text"])
    for ds in (gl.Dataset(src).shuffle(seed=7).batch(10), gl.Dataset(src).shuffle(seed=7, window=3).batch(10)):

        def make(chain: gl.Dataset = ds) -> gl.Loader:
            loader = gl.Loader(chain, workers=2)
            loader.set_epoch(1)
            return loader

        full = check_resume(make, at=9)
        assert sorted(np.concatenate([b["id"] for b in full]).tolist()) == list(range(230))
    halves = [
        np.concatenate([b["id"] for b in gl.Dataset(src).shuffle(seed=1).shard(r, 2).batch(8).iterator(0)])
        for r in (0, 1)
    ]
    assert sorted(np.concatenate(halves).tolist()) == list(range(230)) and not set(halves[0]) & set(halves[1])


@pytest.mark.integration
def test_share_true_serves_every_row_once_through_the_server(folder: pathlib.Path, tmp_path: pathlib.Path) -> None:
    def square(record: dict[str, Any]) -> dict[str, Any]:
        return {"id": record["id"], "square": record["id"] ** 2}

    ds = gl.Dataset(gl.HFDataset(folder)).shuffle(seed=2).map(square, shared=True).batch(10)
    server = Server(tmp_path / "s.sock")
    try:
        with gl.Loader(ds, workers=2, share=True, server=str(server.socket)) as loader:
            ids = np.concatenate([b["id"] for b in loader])
            squares = np.concatenate([b["square"] for b in loader])
    finally:
        server.stop()
    assert sorted(ids.tolist()) == list(range(230))
    assert np.array_equal(np.sort(squares), np.arange(230) ** 2)


def test_fingerprint_tracks_files_and_columns(folder: pathlib.Path) -> None:
    a, b = gl.HFDataset(folder), gl.HFDataset(folder, columns=["id"])
    assert a.fingerprint == gl.HFDataset(folder).fingerprint != b.fingerprint
    arrow = folder / "data-00000-of-00003.arrow"
    os.utime(arrow, ns=(1, 1))
    assert gl.HFDataset(folder).fingerprint != a.fingerprint
    with pytest.raises(gl.errors.SourceError, match=r"changed since the source was made"):
        a[0]


def test_a_path_only_image_reads_its_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pic.jpg").write_bytes(b"\xff\xd8picture")
    table = pa.table(
        {"image": pa.array([{"bytes": b"inline", "path": None}, {"bytes": None, "path": "pic.jpg"}, None])}
    )
    save_like_datasets(tmp_path / "ds", table, {"image": {"_type": "Image"}}, shards=1, rows=8)
    monkeypatch.chdir(tmp_path)  # a relative path is read from the current folder, as datasets opens it
    src = gl.HFDataset(tmp_path / "ds")
    assert [src[i]["image"] for i in range(3)] == [b"inline", b"\xff\xd8picture", None]
    (tmp_path / "pic.jpg").unlink()
    with pytest.raises(gl.errors.SourceError, match=r"column 'image' has no bytes and its file pic.jpg"):
        gl.HFDataset(tmp_path / "ds")[1]


# -- errors ---------------------------------------------------------------------------------------


def test_a_missing_or_incomplete_folder_is_a_named_error(folder: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with pytest.raises(gl.errors.SourceError, match=r"no folder .*nowhere"):
        gl.HFDataset(tmp_path / "nowhere")
    (folder / "state.json").rename(folder / "moved.json")
    with pytest.raises(gl.errors.SourceError, match=r"state.json is missing: not a folder written by .*save_to_disk"):
        gl.HFDataset(folder)
    (folder / "moved.json").write_text("{not json")
    (folder / "moved.json").rename(folder / "state.json")
    with pytest.raises(gl.errors.SourceError, match=r"cannot read .*state.json"):
        gl.HFDataset(folder)
    with pytest.raises(gl.errors.ArgumentError, match=r"folder written by save_to_disk or a datasets.Dataset, got int"):
        gl.HFDataset(3)


@pytest.mark.parametrize("cut", [8, 100, 3000])
def test_a_truncated_arrow_file_is_a_named_error(folder: pathlib.Path, cut: int) -> None:
    """Cut at the end-of-stream marker (whole batches remain), inside a batch, or deep inside."""
    arrow = folder / "data-00001-of-00003.arrow"
    data = arrow.read_bytes()
    arrow.write_bytes(data[:-cut])
    with pytest.raises(gl.errors.SourceError, match=r"data-00001-of-00003.arrow"):
        gl.HFDataset(folder)


def test_a_damaged_arrow_file_is_a_named_error_never_a_wrong_record(folder: pathlib.Path) -> None:
    arrow = folder / "data-00000-of-00003.arrow"
    reader = pa.ipc.open_stream(pa.memory_map(str(arrow)))
    batch = reader.read_next_batch()
    offsets = batch.column("text").buffers()[1]
    data = bytearray(arrow.read_bytes())
    at = data.find(bytes(offsets)[4:40])  # the text offsets of the first batch: make one point far beyond the data
    assert at > 0
    data[at + 4 : at + 8] = (1 << 30).to_bytes(4, "little")
    arrow.write_bytes(bytes(data))
    with pytest.raises(gl.errors.SourceError, match=r"data-00000-of-00003.arrow is damaged \(record batch 0\)"):
        gl.HFDataset(folder, columns=["text"])[3]


def test_an_unknown_or_mismatched_feature_type_is_a_named_error(folder: pathlib.Path) -> None:
    info = json.loads((folder / "dataset_info.json").read_text())
    info["features"]["label"] = {"_type": "Hologram"}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(gl.errors.SourceError, match=r"column 'label' has feature type 'Hologram'.*columns="):
        gl.HFDataset(folder)
    assert gl.HFDataset(folder, columns=["id", "image"])[4]["image"] == b"jpeg-4"  # left out, as the error says
    info["features"]["label"] = {"_type": "Image"}  # a feature its column is not stored as
    (folder / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(gl.errors.SourceError, match=r"data-00000-of-00003.arrow: column 'label' is stored as int64"):
        gl.HFDataset(folder)
    info["features"]["label"] = {"_type": "Array2D", "shape": [2, 2], "dtype": "int64"}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(gl.errors.SourceError, match=r"column 'label' is stored as int64"):
        gl.HFDataset(folder)

"""A shuffle's data as parts of public sources, read whole into NumPy columns: Parquet types,
fsspec URLs, tar shards, sources of any kind, bad files."""

from __future__ import annotations

import gzip
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, SourceError
from globalloader.ray.reader import PART_ROWS, parts_of, read_part
from globalloader.sources import TarWriter


def write_typed(path, rows: int = 10) -> None:
    key = np.arange(rows, dtype=np.int64)
    blob = np.repeat(key[:, None], 4, axis=1).astype(np.uint8)
    table = pa.table(
        {
            "key": key,
            "f32": key.astype(np.float32) / 2,
            "flag": key % 2 == 0,
            "blob": pa.FixedSizeBinaryArray.from_buffers(pa.binary(4), rows, [None, pa.py_buffer(blob.tobytes())]),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 3, dtype=np.float64)), 3),
            "text": [f"row {i}" for i in range(rows)],
            "raw": [bytes([i]) * (i + 1) for i in range(rows)],
        }
    )
    pq.write_table(table, path, row_group_size=4)  # several row groups: chunked columns


def read_columns(data, columns):
    (part,) = parts_of(data, columns, None)
    return read_part(part, columns)


def test_parquet_columns_become_row_major_numpy_arrays(tmp_path):
    path = str(tmp_path / "typed.parquet")
    write_typed(path)
    cols = read_columns(path, None)
    assert cols["key"].dtype == np.int64 and cols["key"].tolist() == list(range(10))
    assert cols["f32"].dtype == np.float32 and cols["f32"][3] == 1.5
    assert cols["flag"].dtype == bool and cols["flag"][:2].tolist() == [True, False]
    assert cols["blob"].shape == (10, 4) and cols["blob"].dtype == np.uint8
    assert (cols["blob"][:, 0] == np.arange(10)).all()
    assert cols["vec"].shape == (10, 3) and cols["vec"][2].tolist() == [6.0, 7.0, 8.0]
    assert cols["text"].dtype == object and cols["text"][7] == "row 7"
    assert cols["raw"][2] == b"\x02\x02\x02"
    assert [p.stop - p.start for p in parts_of(path, None, None)] == [10]


def test_selected_columns_and_fsspec_urls(tmp_path):
    path = tmp_path / "typed.parquet"
    write_typed(str(path))
    cols = read_columns(f"file://{path}", ["vec", "key"])
    assert list(cols) == ["vec", "key"] and cols["key"][-1] == 9


def test_unreadable_or_missing_files_name_the_file(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet at all")
    with pytest.raises(SourceError, match=r"bad\.parquet"):
        parts_of(str(bad), None, None)
    with pytest.raises(SourceError, match=r"missing\.parquet"):
        parts_of(str(tmp_path / "missing.parquet"), None, None)
    good = tmp_path / "good.parquet"
    write_typed(str(good))
    with pytest.raises(SourceError, match=r"good\.parquet"):
        read_columns(str(good), ["no_such_column"])


def test_tar_shards_become_object_columns(tmp_path):
    with TarWriter(str(tmp_path / "shard-%06d.tar"), maxcount=5) as writer:
        for i in range(7):
            writer.write({"__key__": f"k{i:03d}", "cls": i, "bin": bytes([i]) * 3})
    first, second = writer.paths
    assert [p.stop - p.start for p in parts_of([first, second], None, None)] == [5, 2]
    cols = read_columns(second, ["__key__", "cls", "bin"])
    assert cols["__key__"].tolist() == ["k005", "k006"]
    assert cols["cls"].tolist() == [b"5", b"6"] and cols["bin"][1] == b"\x06" * 3
    with pytest.raises(SourceError, match="nope"):
        read_columns(first, ["nope"])


def test_a_source_splits_into_its_files_its_blocks_or_fixed_runs(tmp_path):
    paths = [str(tmp_path / f"p{i}.parquet") for i in range(3)]
    for path, rows in zip(paths, [10, 0, 7], strict=True):
        write_typed(path, rows)
    by_files = parts_of(paths, ["key"], None)
    by_source = parts_of(gl.Dataset(gl.Parquet(paths, columns=["key"])), ["key"], None)
    assert (
        [(p.name, p.stop - p.start) for p in by_source]
        == [(p.name, p.stop - p.start) for p in by_files]
        == [
            (paths[0], 10),
            (paths[1], 0),
            (paths[2], 7),
        ]
    )
    assert read_part(by_source[2], ["key"])["key"].tolist() == list(range(7))
    records = [{"__key__": str(i), "x": i} for i in range(PART_ROWS + 5)]
    parts = parts_of(gl.from_sequence(records), None, None)
    assert [p.stop - p.start for p in parts] == [PART_ROWS, 5]
    assert read_part(parts[1], ["x"])["x"].tolist() == list(range(PART_ROWS, PART_ROWS + 5))


def test_what_ray_cannot_read_is_named(tmp_path):
    with pytest.raises(ArgumentError, match=r"shuffles every epoch itself .*remove \.shuffle"):
        parts_of(gl.Dataset(gl.from_sequence([{"x": 1}])).shuffle(seed=0), None, None)
    with pytest.raises(ArgumentError, match="storage_options= is for files"):
        parts_of(gl.from_sequence([{"x": 1}]), None, {"anon": True})
    with pytest.raises(ArgumentError, match="dicts of columns"):
        read_part(parts_of(gl.from_sequence([1, 2]), None, None)[0], None)


def write_tar_and_gzip(folder) -> tuple[list[str], list[str]]:
    """The same samples as .tar shards and as gzip shards (.tar.gz, then .tgz)."""
    with TarWriter(str(folder / "shard-%06d.tar"), maxcount=5) as writer:
        for i in range(12):
            writer.write({"__key__": f"k{i:03d}", "cls": i, "bin": bytes([i]) * (i + 1)})
    packed = []
    for n, path in enumerate(writer.paths):
        packed.append(path[: -len(".tar")] + (".tgz" if n == 2 else ".tar.gz"))
        pathlib.Path(packed[-1]).write_bytes(gzip.compress(pathlib.Path(path).read_bytes()))
    return writer.paths, packed


def test_gzip_shards_are_streamed_into_the_same_parts_as_tar_shards(tmp_path):
    plain, packed = write_tar_and_gzip(tmp_path)
    plain_parts, packed_parts = parts_of(plain, None, None), parts_of(packed, None, None)
    rows = [(0, 5), (0, 5), (0, 2)]  # a part per shard, rows counted without an index
    assert [(p.start, p.stop) for p in packed_parts] == [(p.start, p.stop) for p in plain_parts] == rows
    mixed = parts_of(gl.TarShards([plain[0], packed[1]]), None, None)  # one source, one shard compressed
    assert [(p.start, p.stop, p.streamed_shard) for p in mixed] == [(0, 5, 0), (5, 10, 1)]
    for a, b in zip([*plain_parts, *plain_parts[:2]], [*packed_parts, *mixed], strict=True):
        cols_a, cols_b = read_part(a, None), read_part(b, None)
        assert cols_a.keys() == cols_b.keys() == {"__key__", "__url__", "cls", "bin"}
        assert all(cols_a[c].tolist() == cols_b[c].tolist() for c in ("__key__", "cls", "bin"))
    assert read_part(packed_parts[2], ["__key__"])["__key__"].tolist() == ["k010", "k011"]


def test_a_corrupt_gzip_shard_is_named_never_dropped(tmp_path):
    _, packed = write_tar_and_gzip(tmp_path)
    blob = pathlib.Path(packed[0]).read_bytes()
    pathlib.Path(packed[0]).write_bytes(blob[: len(blob) // 2])  # cut mid-stream
    with pytest.raises(SourceError, match=r"shard-000000\.tar\.gz"):
        parts_of(packed, None, None)
    # A wrong CRC at the end: every record decompresses, only reading to the end finds it (the
    # record stream does, already when the shard's rows are counted).
    pathlib.Path(packed[0]).write_bytes(blob[:-8] + bytes([blob[-8] ^ 0xFF]) + blob[-7:])
    with pytest.raises(SourceError, match=r"shard-000000\.tar\.gz.*CRC"):
        parts_of(packed, None, None)
    pathlib.Path(packed[1]).write_bytes(b"\x1f\x8b" + b"not deflate" * 10)
    with pytest.raises(SourceError, match=r"shard-000001\.tar\.gz"):
        parts_of(packed[1:], None, None)


def one(r):
    return r


@pytest.mark.parametrize(
    ("chain", "named"),
    [
        (lambda ds: ds.map(one).batch(64), r"cuts batches itself \(batch_size=\): remove \.batch\(64\)"),
        (lambda ds: ds.filter(one).batch(8), r"cuts batches itself \(batch_size=\): remove \.batch\(8\)"),
        (lambda ds: ds.bucket_batch(len, [4], 8), r"cuts batches itself .*remove \.bucket_batch\("),
        (lambda ds: ds.pack(16, key="x"), r"pack each trainer's batches: remove \.pack\("),
        (lambda ds: ds.shuffle(seed=1), r"shuffles every epoch itself \(seed=\): remove \.shuffle\("),
        (lambda ds: ds.shard(0, 2), r"its share itself \(rank=, num_trainers=\): remove \.shard\("),
        (lambda ds: ds.cache().map(one), r"remove \.cache\("),
        (lambda ds: gl.Dataset.concat([ds, ds]), r"reads one source, not concat"),
        (lambda ds: gl.Dataset.stream([{"x": 1}]), r"Dataset\.stream"),
    ],
)
def test_an_operator_ray_cannot_run_per_record_names_itself(chain, named):
    with pytest.raises(ArgumentError, match=named):
        parts_of(chain(gl.Dataset(gl.from_sequence([{"x": np.arange(3)}] * 4))), None, None)


def test_a_select_reads_only_its_rows_of_each_part_with_repeats():
    records = [{"__key__": str(i), "x": i} for i in range(PART_ROWS + 5)]
    chain = gl.Dataset(gl.from_sequence(records)).select([PART_ROWS + 3, 2, PART_ROWS + 3, 9])
    first, second = parts_of(chain, None, None)
    assert (first.rows, second.rows) == (2, 2)
    assert read_part(first, ["x"])["x"].tolist() == [2, 9]  # source-index order
    assert read_part(second, ["x"])["x"].tolist() == [PART_ROWS + 3] * 2


def test_a_select_over_arrow_blocks_takes_its_rows_from_the_columns(tmp_path):
    path = str(tmp_path / "typed.parquet")
    write_typed(path)
    (part,) = parts_of(gl.Dataset(gl.Parquet(path)).select([7, 1, 7]), None, None)
    cols = read_part(part, ["key", "vec"])
    assert cols["key"].tolist() == [1, 7, 7] and cols["vec"][0].tolist() == [3.0, 4.0, 5.0]

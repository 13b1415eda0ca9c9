"""LitData: datasets written by LitData's own `optimize`, read by gl.LitData and compared with
LitData's own StreamingDataset record by record; damaged datasets refused by name."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import struct
from typing import Any

import numpy as np
import pytest
from peers import run_peer

import globalloader as gl
from globalloader import storage
from globalloader.errors import SourceError
from helpers import check_resume, same, stop_server
from tests.storage.conftest import moto_server, proxy, s3  # noqa: F401  (the moto server fixtures)

# Writes the datasets with LitData's optimize, then reads every record back with its
# StreamingDataset (JPEG kept as its bytes: decoding it needs torchvision, and gl gives bytes).
# optimize's workers import the item functions by module: they live in a file of their own.
ITEMS = """
import io
import numpy as np, torch
from PIL import Image

def jpeg(i):
    pixels = ((np.arange(24 * 16 * 3) * (i + 3)) % 251).astype(np.uint8).reshape(16, 24, 3)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    buf.seek(0)
    return Image.open(buf)

def mixed(i):
    return {
        "i": i, "f": i * 0.25 - 1.5, "s": f"caf\\u00e9 {i}", "b": bytes(range(i % 7)) * 3, "ok": i % 3 == 0,
        "u8": np.arange(i + 1, dtype=np.uint8), "f64": np.linspace(0, 1, i + 2),
        "grid": (np.arange(6, dtype=np.int32) * i).reshape(2, 3),
        "t1": torch.arange(i + 2, dtype=torch.int16), "t2": torch.ones(2, 3, dtype=torch.float32) * i,
        "img": jpeg(i), "pil": Image.fromarray(np.full((5, 4, 3), i, np.uint8)),
        "nest": (i, {"a": f"x{i}", "l": [i, i + 1]}),
        # Lists in a dict item are kept whole, as one `json` leaf of LitData's tagged encoding.
        "caps": [f"c{j}" for j in range(i % 4)], "ids": list(range(i % 5)), "w": [0.5 * i, -1.0],
        "on": [True, i % 2 == 0], "rows": [{"k": f"r{i}", "n": i, "x": 1.5, "b": False, "z": None}],
        "meta": {"deep": {"n": i, "s": "t", "f": 2.5, "b": True, "none": None}, "mixed": [1, "a"]},
    }

def flat(i):
    return {"i": i, "s": f"row {i}", "f": i / 8, "tags": [f"t{i}"] * (i % 3)}

def scalar(i):
    return i * 3

def convert(x):
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: convert(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(convert(v) for v in x)
    if isinstance(x, memoryview):
        return bytes(x)
    if type(x).__module__.startswith("PIL"):
        return np.asarray(x)
    return x
"""
PEER = """
import shutil
import numpy as np, torch
from litdata import optimize, StreamingDataset
from litdata.streaming.serializers import BytesSerializer
from litdata.streaming.writer import BinaryWriter
open("lit_items.py", "w").write(INPUTS["items"])
from lit_items import convert, mixed, flat, scalar

def write(name, fn, **kwargs):
    # LitData's writer, in this process: what optimize's workers run, without their start-up.
    writer = BinaryWriter(name, **{"chunk_bytes": 1500, **kwargs})
    for i in range(INPUTS["n"]):
        writer[i] = fn(i)
    writer.done()
    writer.merge()

OUTPUT = {}
optimize(fn=mixed, inputs=list(range(INPUTS["n"])), output_dir="plain", chunk_bytes=1500, num_workers=2)
write("zstd", mixed, compression="zstd")
write("zstd_chunk", mixed, compression="zstd", compression_level="chunk")
# LitData's reader inflates `.zstd.bin` chunks of a local folder in place: keep them as written.
shutil.copytree("zstd_chunk", "zstd_chunk_packed")
write("zstd_sample", mixed, compression="zstd", compression_level="sample")
write("flat", flat, chunk_bytes=None, chunk_size=5)
write("scalar", scalar, chunk_bytes=None, chunk_size=5)
for name in ("plain", "zstd", "zstd_chunk", "zstd_sample", "flat", "scalar"):
    ds = StreamingDataset(name, serializers={"jpeg": BytesSerializer()})
    OUTPUT[name] = [convert(ds[i]) for i in range(len(ds))]
"""
N = 24


@pytest.fixture(scope="module")
def peer_datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, list[Any]]]:
    folder = tmp_path_factory.mktemp("litdata")
    return folder, run_peer(PEER, folder, n=N, items=ITEMS)


def without_key(record: dict[str, Any]) -> Any:
    return {k: v for k, v in record.items() if k != "__key__"}


@pytest.mark.slow
def test_every_record_is_what_litdata_reads(peer_datasets: tuple[pathlib.Path, dict[str, list[Any]]]) -> None:
    folder, peer = peer_datasets
    for name, expected in peer.items():
        source = gl.LitData(folder / name)
        assert len(source) == len(expected) == N, name
        assert len(source.block_starts) > 2, f"{name}: several chunks"
        for i, want in enumerate(expected):
            record = source[i]
            assert record["__key__"].endswith(f".bin:{i - int(source.block_starts[source.block_starts <= i][-1])}")
            got = record["item"] if name == "scalar" else without_key(record)
            assert same(got, want), f"{name}[{i}]: {got!r} != {want!r}"
    # The whole-file zstd chunks as LitData wrote them (its reader had inflated the others).
    packed = gl.LitData(folder / "zstd_chunk_packed")
    assert all(name.endswith(".zstd.bin") for name in os.listdir(folder / "zstd_chunk_packed") if "chunk-" in name)
    assert all(same(without_key(packed[i]), peer["zstd_chunk"][i]) for i in range(N))
    # A record is the caller's own: changing it changes no later read (Arrow rows are kept per chunk).
    flat_rows = gl.LitData(folder / "flat")
    flat_rows[4]["tags"].append("changed")
    assert same(without_key(flat_rows[4]), peer["flat"][4])
    # JPEGs come as their encoded bytes: the fast decode path reads them.
    pytest.importorskip("PIL")
    assert gl.LitData(folder / "zstd")[3]["img"][:2] == b"\xff\xd8"


@pytest.mark.slow
def test_shuffle_by_chunk_resumes_exactly_with_two_workers(
    peer_datasets: tuple[pathlib.Path, dict[str, list[Any]]],
) -> None:
    folder, peer = peer_datasets
    for name in ("plain", "zstd"):
        ds = gl.Dataset(gl.LitData(folder / name)).shuffle(seed=4, window=2)
        full = check_resume(lambda ds=ds: gl.Loader(ds, workers=2, mode="process"), at=7)
        assert sorted(r["i"] for r in full) == list(range(N))
        assert [r["i"] for r in full] != list(range(N))
        by_i = {want["i"]: want for want in peer[name]}  # optimize's two workers wrote "plain" out of order
        assert all(same(without_key(r), by_i[r["i"]]) for r in full)


@pytest.mark.slow
def test_a_dataset_in_s3_reads_through_the_cache_and_keys_on_etags(
    peer_datasets: tuple[pathlib.Path, dict[str, list[Any]]],
    s3: dict[str, Any],  # noqa: F811  (the fixture)
) -> None:
    folder, peer = peer_datasets
    root = f"s3://{s3['bucket']}/zstd"
    fs, _ = storage.Store(s3["options"]).filesystem(root)
    for file in sorted((folder / "zstd").iterdir()):
        fs.put_file(str(file), f"{root}/{file.name}")
    source = gl.LitData(root, storage_options=s3["options"])
    assert source.remote
    assert all(same(without_key(source[i]), peer["zstd"][i]) for i in range(N))
    before = s3["proxy"].total_bytes(f"/{s3['bucket']}/zstd/chunk")
    again = pickle.loads(pickle.dumps(source))  # a worker: the machine cache holds every chunk already
    assert all(same(without_key(again[i]), peer["zstd"][i]) for i in range(N))
    with gl.Loader(gl.Dataset(again).shuffle(seed=1, window=2), workers=2) as loader:  # prefetching the chunks
        records = list(loader)
    assert sorted(r["i"] for r in records) == list(range(N))
    assert all(same(without_key(r), peer["zstd"][r["i"]]) for r in records)
    after = s3["proxy"].total_bytes(f"/{s3['bucket']}/zstd/chunk")
    assert after == before, f"{after - before} more bytes of chunks downloaded: the machine cache held them all"
    # Chunks of Arrow rows are read in place from their checked copies in the machine cache.
    for file in sorted((folder / "flat").iterdir()):
        fs.put_file(str(file), f"s3://{s3['bucket']}/flat/{file.name}")
    rows = gl.LitData(f"s3://{s3['bucket']}/flat", storage_options=s3["options"])
    assert rows.remote and all(same(without_key(rows[i]), peer["flat"][i]) for i in range(N))
    assert all(same(without_key(rows[i]), peer["flat"][i]) for i in reversed(range(N)))
    # A rewritten chunk changes its ETag, hence the fingerprint (the key shared jobs meet on).
    first = source.chunks[1]
    data = fs.cat_file(first)
    fs.pipe_file(first, data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert gl.LitData(root, storage_options=s3["options"]).fingerprint != source.fingerprint


# Damaged datasets, written by hand in the plain layout (ints and strings).
def write_plain(folder: pathlib.Path, items: list[tuple[int, str]], per_chunk: int = 3) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    chunks = []
    for c in range(0, len(items), per_chunk):
        body = [
            struct.pack("<II", 8, len(s.encode())) + struct.pack("<q", i) + s.encode()
            for i, s in items[c : c + per_chunk]
        ]
        offsets = np.cumsum([4 * (len(body) + 2), *map(len, body)]).astype("<u4")
        data = struct.pack("<I", len(body)) + offsets.tobytes() + b"".join(body)
        name = f"chunk-0-{c // per_chunk}.bin"
        (folder / name).write_bytes(data)
        chunks.append({"filename": name, "chunk_size": len(body), "chunk_bytes": len(data), "dim": None})
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.dict", "context": json.dumps(["i", "s"]), "children_spec": [leaf, leaf]}]
    config = {"data_format": ["int", "str"], "data_spec": json.dumps(spec), "compression": None, "encryption": None}
    (folder / "index.json").write_text(json.dumps({"chunks": chunks, "config": config}))
    return folder


def test_records_rebuild_their_dicts_and_pickle_to_workers(tmp_path: pathlib.Path) -> None:
    items = [(i * 7 - 3, f"s{i}" * i) for i in range(8)]
    source = pickle.loads(pickle.dumps(gl.LitData(write_plain(tmp_path / "d", items) / "index.json")))
    assert [source[i] for i in range(len(source))] == [
        {"__key__": f"chunk-0-{i // 3}.bin:{i % 3}", "i": n, "s": s} for i, (n, s) in enumerate(items)
    ]
    assert source.block_starts.tolist() == [0, 3, 6]
    with pytest.raises(gl.errors.SampleIndexError):
        source[8]


@pytest.mark.integration
def test_two_jobs_share_one_server_over_a_litdata_dataset(tmp_path: pathlib.Path) -> None:
    source = gl.LitData(write_plain(tmp_path / "d", [(i, f"s{i}") for i in range(10)]))
    chain = gl.Dataset(source).shuffle(seed=3).map(lambda r: {"i": r["i"], "s": r["s"]}, shared=True)
    sock = tmp_path / "gl.sock"
    try:
        runs = []
        for _ in range(2):
            with gl.Loader(chain, workers=0, share=True, server=str(sock), server_memory="8M") as loader:
                runs.append(list(loader))
    finally:
        stop_server(sock)
    assert runs[0] == runs[1] and sorted(r["i"] for r in runs[0]) == list(range(10))


def edit_index(folder: pathlib.Path, change: Any) -> None:
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


def test_damaged_datasets_are_named_errors_never_wrong_records(tmp_path: pathlib.Path) -> None:
    items = [(i, f"v{i}") for i in range(6)]
    good = write_plain(tmp_path / "good", items)

    def damaged(name: str) -> pathlib.Path:
        return pathlib.Path(shutil.copytree(good, tmp_path / name))

    with pytest.raises(SourceError, match=r"has no LitData index\.json"):
        gl.LitData(tmp_path)
    corrupt = damaged("corrupt")
    (corrupt / "index.json").write_bytes((good / "index.json").read_bytes()[:40])
    with pytest.raises(SourceError, match=r"corrupt/index.json is not a LitData index"):
        gl.LitData(corrupt)
    short = damaged("short")
    (short / "chunk-0-1.bin").write_bytes((good / "chunk-0-1.bin").read_bytes()[:-2])
    with pytest.raises(SourceError, match=r"chunk-0-1.bin has \d+ bytes, index.json says"):
        gl.LitData(short)
    unknown = damaged("unknown")
    edit_index(unknown, lambda ix: ix["config"].__setitem__("data_format", ["int", "hologram"]))
    with pytest.raises(SourceError, match=r"data_format 'hologram' is not read here"):
        gl.LitData(unknown)
    edit_index(unknown, lambda ix: ix["config"].__setitem__("data_format", ["int", "video"]))
    with pytest.raises(SourceError, match="data_format 'video' is not read here"):
        gl.LitData(unknown)
    # A pickle leaf is read only when it holds None (LitData pickles None values): others would run code.
    edit_index(unknown, lambda ix: ix["config"].__setitem__("data_format", ["int", "pickle"]))
    with pytest.raises(SourceError, match=r"chunk-0-0.bin \(item 0\) cannot be read: .*would run code"):
        gl.LitData(unknown)[0]
    edit_index(unknown, lambda ix: ix["config"].__setitem__("data_format", ["int"]))
    with pytest.raises(SourceError, match="data_spec has 2 leaves, data_format 1"):
        gl.LitData(unknown)
    encrypted = damaged("encrypted")
    edit_index(encrypted, lambda ix: ix["config"].__setitem__("encryption", {"level": "chunk"}))
    with pytest.raises(SourceError, match="encrypted"):
        gl.LitData(encrypted)
    # The same size, other counts: the chunk's header disagrees with index.json.
    miscounted = damaged("miscounted")
    edit_index(miscounted, lambda ix: ix["chunks"][0].__setitem__("chunk_size", 2))
    with pytest.raises(SourceError, match=r"chunk-0-0.bin does not hold the 2 items"):
        gl.LitData(miscounted)[0]
    # An item whose field sizes do not add up to its bytes.
    garbled = damaged("garbled")
    data = bytearray((good / "chunk-0-0.bin").read_bytes())
    data[20:24] = struct.pack("<I", 9)  # item 0's first field claims 9 bytes
    (garbled / "chunk-0-0.bin").write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"chunk-0-0.bin \(item 0\) cannot be read: its fields take"):
        gl.LitData(garbled)[0]

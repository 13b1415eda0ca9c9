"""gl.MDS: Mosaic Streaming's format read without Mosaic, record for record as Mosaic reads it
(every encoding, every compression: proved in the peers' environment), through the loader's
workers with shuffle and exact resume, from S3, and refusing every damaged dataset by name."""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
import pickle
import re
import sys
from typing import Any

import numpy as np
import pytest
from peers import run_peer

import globalloader as gl
from globalloader import storage
from globalloader.errors import MissingExtraError, SourceError
from helpers import Server, check_resume, same


def write_mds(
    folder: pathlib.Path, n: int = 10, per_shard: int = 4, compression: str | None = None, sha1: bool = False
) -> pathlib.Path:
    """A small MDS dataset as MDSWriter lays it out (columns `id`: int, `text`: str, `image`:
    jpeg), `per_shard` samples a shard; written here so that the tests without the peers'
    environment have one (the peer test below proves the layout against Mosaic's own reader)."""
    folder.mkdir(parents=True, exist_ok=True)
    names, encodings, sizes = ["id", "image", "text"], ["int", "jpeg", "str"], [8, None, None]
    shards = []
    for s, first in enumerate(range(0, n, per_shard)):
        samples = []
        for i in range(first, min(n, first + per_shard)):
            image, text = b"\xff\xd8jpeg-%d" % i, f"sample {i}".encode()
            samples.append(np.array([len(image), len(text)], "<u4").tobytes() + np.int64(i).tobytes() + image + text)
        config = json.dumps({"format": "mds", "version": 2}).encode()
        start = 4 + 4 * (len(samples) + 1) + len(config)
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in samples])]) + start
        raw = np.uint32(len(samples)).tobytes() + offsets.astype("<u4").tobytes() + config + b"".join(samples)
        raw_info = _file(f"shard.{s:05d}.mds", raw, sha1)
        zip_info = None
        if compression == "gz":
            packed = gzip.compress(raw, mtime=0)
            zip_info = _file(f"shard.{s:05d}.mds.gz", packed, sha1)
            (folder / zip_info["basename"]).write_bytes(packed)
        else:
            (folder / raw_info["basename"]).write_bytes(raw)
        shards.append(
            {
                "format": "mds",
                "version": 2,
                "column_names": names,
                "column_encodings": encodings,
                "column_sizes": sizes,
                "compression": compression,
                "hashes": ["sha1"] if sha1 else [],
                "raw_data": raw_info,
                "zip_data": zip_info,
                "samples": len(samples),
                "size_limit": 1 << 26,
            }
        )
    (folder / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))
    return folder


def _file(basename: str, data: bytes, sha1: bool) -> dict[str, Any]:
    return {
        "basename": basename,
        "bytes": len(data),
        "hashes": {"sha1": hashlib.sha1(data).hexdigest()} if sha1 else {},
    }


def test_records_number_samples_shard_after_shard(tmp_path: pathlib.Path) -> None:
    src = gl.MDS(write_mds(tmp_path / "ds", n=10, per_shard=4))
    assert len(src) == 10 and src.block_starts.tolist() == [0, 4, 8]
    assert src[5] == {"__key__": "shard.00001.mds:1", "id": 5, "image": b"\xff\xd8jpeg-5", "text": "sample 5"}
    assert gl.MDS(tmp_path / "ds" / "index.json").fingerprint == src.fingerprint
    copy = pickle.loads(pickle.dumps(src))  # as a spawned worker or the shared server gets it
    assert [copy[i] for i in range(10)] == [src[i] for i in range(10)]


@pytest.mark.parametrize("compression", [None, "gz"])
@pytest.mark.parametrize("window", [None, 2])
def test_shuffle_and_resume_through_two_workers_is_exact(
    tmp_path: pathlib.Path, compression: str | None, window: int | None
) -> None:
    src = gl.MDS(write_mds(tmp_path / "ds", n=30, per_shard=4, compression=compression))
    ds = gl.Dataset(src).shuffle(seed=3, window=window).batch(4)
    full = check_resume(lambda: gl.Loader(ds, workers=2), at=3)
    ids = [int(i) for batch in full for i in batch["id"]]
    assert sorted(ids) == list(range(30)) and ids != sorted(ids)


@pytest.mark.integration
def test_shared_mode_serves_a_compressed_dataset_and_resumes_exactly(tmp_path: pathlib.Path) -> None:
    """share=True: the server's decoders read the dataset by its fingerprint; a resumed loader,
    shared or not, serves exactly what remains of the epoch."""
    src = gl.MDS(write_mds(tmp_path / "ds", n=30, per_shard=4, compression="gz"))
    ds = gl.Dataset(src).shuffle(seed=5, window=2).batch(3)
    server = Server(tmp_path / "s.sock")
    try:
        with gl.Loader(ds, workers=2, share=True, server=str(server.socket)) as loader:
            it = iter(loader)
            head = [int(i) for _ in range(4) for i in next(it)["id"]]
            state = loader.state_dict()
        for share in (True, False):
            with gl.Loader(ds, workers=2, share=share, server=str(server.socket)) as resumed:
                resumed.load_state_dict(state)
                rest = [int(i) for batch in resumed for i in batch["id"]]
            assert sorted(head + rest) == list(range(30))
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "s.log").read_text()


def test_an_s3_dataset_reads_as_its_local_copy_through_the_machine_cache(
    s3: dict[str, Any], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "cache"))
    store = storage.Store(s3["options"])
    for compression in (None, "gz"):
        local = write_mds(tmp_path / str(compression), n=12, per_shard=5, compression=compression, sha1=True)
        url = f"s3://{s3['bucket']}/{compression}"
        for file in local.iterdir():
            with store.open_write(f"{url}/{file.name}") as out:
                out.write(file.read_bytes())
        remote = gl.MDS(url, storage_options=s3["options"])
        assert remote.remote and remote.fingerprint != gl.MDS(local).fingerprint
        with gl.Loader(gl.Dataset(remote).shuffle(seed=1, window=2), workers=2) as loader:
            read = sorted((r for r in loader), key=lambda r: r["id"])
        assert same(read, [gl.MDS(local)[i] for i in range(12)])
        proxy, prefix = s3["proxy"], f"/{s3['bucket']}/{compression}/shard"
        assert proxy.total_bytes(prefix) == sum(st.size for st in remote._stats)  # each shard downloaded once


def _cut(folder: pathlib.Path) -> None:
    shard = folder / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-3])


def _flip(folder: pathlib.Path) -> None:
    shard = folder / "shard.00001.mds"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))


def _index(change: Any) -> Any:
    def edit(folder: pathlib.Path) -> None:
        index = json.loads((folder / "index.json").read_text())
        change(index["shards"][1])
        (folder / "index.json").write_text(json.dumps(index))

    return edit


DAMAGES = {
    "no index": (lambda f: (f / "index.json").unlink(), "index.json"),
    "index not JSON": (lambda f: (f / "index.json").write_text('{"version": 2, "sha'), "index.json is not JSON"),
    "index of another version": (lambda f: (f / "index.json").write_text('{"version": 1}'), "not a Mosaic"),
    "shard cut short": (_cut, r"shard.00001.mds holds \d+ bytes, .*index.json says"),
    "shard damaged": (_flip, "shard.00001.mds does not match its sha1 hash"),
    "unknown encoding": (_index(lambda s: s["column_encodings"].__setitem__(1, "webp")), "encoding 'webp'"),
    "encoding not a name": (_index(lambda s: s["column_encodings"].__setitem__(1, 5)), "encodings strings"),
    "unknown compression": (_index(lambda s: s.update(compression="lz4")), "compression 'lz4'"),
    "pickled column": (_index(lambda s: s["column_encodings"].__setitem__(1, "pkl")), "allow_pickle=True"),
    "column size disagrees": (
        _index(lambda s: s["column_sizes"].__setitem__(0, 4)),
        "column_size 4, its encoding takes 8",
    ),
    "header disagrees": (_index(lambda s: s.update(samples=3)), "its header says 4 samples, the index 3"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_dataset_is_an_error_naming_its_file(tmp_path: pathlib.Path, damage: str) -> None:
    change, message = DAMAGES[damage]
    folder = write_mds(tmp_path / "ds", n=12, per_shard=4, sha1=True)
    change(folder)
    with pytest.raises(SourceError, match=message):
        _read_all(folder)


def _read_all(folder: pathlib.Path) -> list[dict[str, Any]]:
    src = gl.MDS(folder)
    return [src[i] for i in range(len(src))]


def test_a_zstd_dataset_without_its_library_names_the_extra(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_mds(tmp_path / "ds")
    _index(lambda s: s.update(compression="zstd:7", zip_data=s["raw_data"]))(folder)
    monkeypatch.setitem(sys.modules, "cramjam", None)  # what a missing module looks like to import
    with pytest.raises(MissingExtraError, match=re.escape("globalloader[formats]")):
        gl.MDS(folder)


_PEER_WRITE_AND_READ = """
import decimal, io
import numpy as np
from PIL import Image
from streaming import MDSWriter, StreamingDataset

def plain(value):
    # Mosaic opens encoded images lazily over their bytes: those bytes are what gl gives
    if isinstance(value, Image.Image):
        fp = getattr(value, "fp", None)
        if isinstance(fp, io.BytesIO):
            return fp.getvalue()
        return ("pil", value.mode, value.size, value.tobytes())
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value

columns = {
    "int": "int", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u16": "uint16",
    "u32": "uint32", "u64": "uint64", "f16": "float16", "f32": "float32", "f64": "float64", "str": "str",
    "bytes": "bytes", "json": "json", "pkl": "pkl", "str_int": "str_int", "str_float": "str_float",
    "str_decimal": "str_decimal", "nd": "ndarray", "nd_dtype": "ndarray:int16", "nd_fixed": "ndarray:float32:2,3",
    "jpeg": "jpeg", "png": "png", "pil": "pil", "list_jpeg": "list[jpeg]", "list_png": "list[png]",
    "list_pil": "list[pil]", "jpeg_array": "jpeg_array", "jpegarray": "jpegarray",
}
rng = np.random.default_rng(0)
OUTPUT = {}
for name, compression in INPUTS["compressions"].items():
    folder = f"ds-{name}"
    hashes = ["sha1", "xxh64"]
    with MDSWriter(out=folder, columns=columns, compression=compression, hashes=hashes, size_limit=6000) as out:
        for i in range(13):
            image = Image.fromarray(rng.integers(0, 255, (6 + i, 5, 3), dtype=np.uint8))
            small = Image.fromarray(rng.integers(0, 255, (4, 3), dtype=np.uint8), mode="L")
            jpeg = io.BytesIO()
            image.save(jpeg, format="JPEG")
            out.write({
                "int": -(2**40) * i, "i8": -i, "i16": -300 * i, "i32": -(2**20) * i, "i64": -(2**50) * i, "u8": 200 + i,
                "u16": 60000 + i, "u32": 2**31 + i, "u64": 2**63 + i, "f16": i / 3, "f32": i / 3, "f64": i / 3,
                "str": "é" * i, "bytes": bytes(range(i)), "json": {"i": [i, None, "x"]}, "pkl": {"set": {i}},
                "str_int": 10**30 + i, "str_float": i / 7, "str_decimal": decimal.Decimal(f"{i}.{10**20 + i}"),
                "nd": rng.standard_normal((i + 1, 300 if i == 5 else 2)), "nd_dtype": np.arange(i + 1, dtype=np.int16),
                "nd_fixed": np.full((2, 3), i, np.float32), "jpeg": image, "png": image, "pil": small,
                "list_jpeg": [image, image], "list_png": [image], "list_pil": [small, small],
                "jpeg_array": [jpeg.getvalue()] * (1 + i % 2), "jpegarray": [jpeg.getvalue()],
            })
    dataset = StreamingDataset(local=folder, shuffle=False, batch_size=1, allow_unsafe_types=True)
    OUTPUT[name] = [{k: plain(v) for k, v in dataset[i].items()} for i in range(len(dataset))]
"""


def _plain(value: Any) -> Any:
    """A `pil` value as the peer script gives it (PIL images do not compare by ==)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return ("pil", value.mode, value.size, value.tobytes())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@pytest.mark.slow
def test_every_encoding_and_compression_reads_as_mosaic_reads_it(tmp_path: pathlib.Path) -> None:
    """Written by Mosaic's MDSWriter (several shards each, sha1 and xxh64 hashes), read by its
    StreamingDataset and by gl.MDS: the same values, of the same types, in the same order."""
    compressions = {"raw": None, "zstd": "zstd:7", "gz": "gz", "snappy": "snappy", "br": "br", "bz2": "bz2:5"}
    theirs = run_peer(_PEER_WRITE_AND_READ, tmp_path, compressions=compressions)
    for name in compressions:
        src = gl.MDS(tmp_path / f"ds-{name}", allow_pickle=True)
        assert len(src.shards) > 2, name
        ours = [{k: _plain(v) for k, v in src[i].items() if k != "__key__"} for i in range(len(src))]
        assert len(ours) == len(theirs[name]) == 13
        for mine, peer in zip(ours, theirs[name], strict=True):
            assert same(mine, peer), (name, {k: (mine[k], peer[k]) for k in mine if not same(mine[k], peer[k])})
            assert {k: type(v) for k, v in mine.items()} == {k: type(v) for k, v in peer.items()}, name


@pytest.mark.parametrize(
    ("sha1", "message"), [(True, "mds.gz does not match its sha1 hash"), (False, "cannot decompress")]
)
def test_a_damaged_compressed_shard_is_never_decompressed_into_the_cache(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, sha1: bool, message: str
) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_mds(tmp_path / "ds", n=12, per_shard=4, compression="gz", sha1=sha1)
    shard = folder / "shard.00001.mds.gz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    src = gl.MDS(folder)
    assert src[0]["id"] == 0  # the other shards read
    for _ in range(2):  # and stay refused: nothing was kept
        with pytest.raises(SourceError, match=message):
            src[4]

"""TarWriter shards are read back by the real webdataset library and by TarShards."""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

import numpy as np
import pytest
import webdataset as wds

from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import TarShards, TarWriter


def _sample(i: int) -> dict:
    return {
        "__key__": f"train/s{i:05d}",
        "jpg": bytes([i % 256]) * (50 + i),
        "txt": f"héllo {i}",
        "cls": i,
        "score": i / 3,
        "npy": np.arange(i, dtype=np.float32).reshape(-1, 1),
        "json": {"id": i, "tags": ["a", "b"]},
        "__ignored__": "not written",
    }


def _member_count(path: str) -> int:
    with tarfile.open(path) as tar:
        return len(tar.getmembers())


def test_webdataset_decodes_what_was_written(tmp_path: pathlib.Path) -> None:
    with TarWriter(str(tmp_path / "out-%03d.tar"), maxcount=4) as writer:
        for i in range(10):
            writer.write(_sample(i))
    assert writer.paths == [str(tmp_path / f"out-{s:03d}.tar") for s in range(3)]
    decoded = list(wds.WebDataset(writer.paths, shardshuffle=False).decode())
    assert len(decoded) == 10
    for i, sample in enumerate(decoded):
        expected = _sample(i)
        assert sample["__key__"] == expected["__key__"]
        assert sample["jpg"] == expected["jpg"] or np.array_equal(sample["jpg"], expected["jpg"])
        assert sample["txt"] == expected["txt"]
        assert sample["cls"] == i  # webdataset's .cls decoder parses the decimal text
        assert float(sample["score"].decode()) == expected["score"]
        assert np.array_equal(sample["npy"], expected["npy"])
        assert sample["json"] == expected["json"]
        assert "__ignored__" not in sample and "ignored" not in sample


def test_tarshards_reads_raw_bytes(tmp_path: pathlib.Path) -> None:
    with TarWriter(str(tmp_path / "one.tar")) as writer:
        for i in range(3):
            writer.write(_sample(i))
    record = TarShards(writer.paths)[2]
    assert record["txt"] == "héllo 2".encode()
    assert record["cls"] == b"2" and record["score"] == repr(2 / 3).encode()
    assert np.array_equal(np.load(io.BytesIO(record["npy"])), _sample(2)["npy"])
    assert json.loads(record["json"]) == {"id": 2, "tags": ["a", "b"]}
    raw = list(wds.WebDataset(writer.paths, shardshuffle=False))
    assert [r["npy"] for r in raw] == [TarShards(writer.paths)[i]["npy"] for i in range(3)]


def test_rolls_by_size(tmp_path: pathlib.Path) -> None:
    with TarWriter(str(tmp_path / "s-%d.tar"), maxsize=10_000) as writer:
        for i in range(10):
            writer.write({"__key__": f"k{i}", "bin": b"x" * 3000})  # 3584 bytes in the tar
    assert len(writer.paths) == 5
    assert all(pathlib.Path(p).stat().st_size <= 10_000 + 1024 * 10 for p in writer.paths)
    assert [_member_count(p) for p in writer.paths] == [2] * 5
    # one sample bigger than maxsize still gets a shard of its own
    with TarWriter(str(tmp_path / "big-%d.tar"), maxsize=100) as writer:
        writer.write({"__key__": "a", "bin": b"x" * 1000})
        writer.write({"__key__": "b", "bin": b"x" * 1000})
    assert len(writer.paths) == 2


def test_same_samples_same_bytes(tmp_path: pathlib.Path) -> None:
    for name in ("a.tar", "b.tar"):
        with TarWriter(str(tmp_path / name)) as writer:
            for i in range(3):
                writer.write(_sample(i))
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


def test_long_keys_round_trip(tmp_path: pathlib.Path) -> None:
    key = "deep/" * 40 + "sample"
    with TarWriter(str(tmp_path / "long.tar")) as writer:
        writer.write({"__key__": key, "txt": "x"})
    assert TarShards(writer.paths)[0]["__key__"] == key
    assert next(iter(wds.WebDataset(writer.paths, shardshuffle=False)))["__key__"] == key


def test_writes_to_fsspec_url(tmp_path: pathlib.Path) -> None:
    url = f"memory://{tmp_path.name}/w.tar"
    with TarWriter(url) as writer:
        writer.write({"__key__": "a", "txt": "remote"})
    assert TarShards(url)[0]["txt"] == b"remote"


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"txt": "no key"}, "__key__"),
        ({"__key__": 3, "txt": "x"}, "__key__"),
        ({"__key__": "a.b", "txt": "x"}, "'a.b'.*no dot"),
        ({"__key__": "k", "TXT": "x"}, "field name 'TXT'"),
        ({"__key__": "k", "obj": object()}, "field 'obj' has unsupported type object"),
        ({"__key__": "k", "arr": np.array([object()])}, "field 'arr' is an object array"),
        ({"__key__": "k", "json": {"a": object()}}, "field 'json' is not JSON-serializable"),
        ({"__key__": "k", "json": {"a": [{0: "cat"}]}}, "field 'json' has a dict key that is not a str"),
        ({"__key__": "k"}, "no fields"),
        ("not a dict", "must be a dict"),
    ],
)
def test_bad_samples(tmp_path: pathlib.Path, sample: object, message: str) -> None:
    with TarWriter(str(tmp_path / "bad.tar")) as writer, pytest.raises(ArgumentError, match=message):
        writer.write(sample)  # type: ignore[arg-type]


def test_bad_usage(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ArgumentError, match="no printf field"):
        TarWriter(str(tmp_path / "plain.tar"), maxcount=3)
    with pytest.raises(ArgumentError, match="maxcount"):
        TarWriter(str(tmp_path / "s-%d.tar"), maxcount=0)
    with pytest.raises(ArgumentError, match="pattern must be"):
        TarWriter(42)  # type: ignore[arg-type]
    writer = TarWriter(str(tmp_path / "once.tar"))
    writer.write({"__key__": "a", "txt": "1"})
    with pytest.raises(ArgumentError, match="repeats the previous"):
        writer.write({"__key__": "a", "txt": "2"})
    writer.close()
    writer.close()
    with pytest.raises(ArgumentError, match="closed"):
        writer.write({"__key__": "b", "txt": "3"})
    (tmp_path / "blocker").write_text("a file where a folder should be")
    with pytest.raises(SourceError, match="blocker"):
        TarWriter(str(tmp_path / "blocker" / "x.tar")).write({"__key__": "a", "txt": "1"})


def test_a_shard_appears_only_whole(tmp_path: pathlib.Path) -> None:
    """While a shard is written, nothing is at its name (a killed writer leaves no short shard
    that reads as whole), and `abort()` drops it."""
    writer = TarWriter(tmp_path / "out-%03d.tar", maxcount=2)
    for i in range(3):
        writer.write(_sample(i))
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert visible == ["out-000.tar", "out-000.tar.idx"]  # out-001.tar is being written
    writer.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-000.tar", "out-000.tar.idx"]
    assert writer.paths == [str(tmp_path / "out-000.tar")]
    assert len(TarShards([str(tmp_path / "out-000.tar")])) == 2


def test_numbers_from_first_shard(tmp_path: pathlib.Path) -> None:
    with TarWriter(tmp_path / "out-%03d.tar", maxcount=2, first_shard=5) as writer:
        for i in range(3):
            writer.write(_sample(i))
    assert writer.paths == [str(tmp_path / "out-005.tar"), str(tmp_path / "out-006.tar")]


def test_the_bytes_are_those_tarfile_writes(tmp_path: pathlib.Path) -> None:
    # headers are built directly (not by tarfile): short ASCII names, and names that need pax
    # records (long, non-ASCII), give byte for byte tarfile's archive, end padding included
    keys = ["a", "train/s00001", "k" * 120, "héllo/wörld"]
    samples = [{"__key__": key, "jpg": bytes(range(i * 300 % 256)) * (i + 1), "txt": key} for i, key in enumerate(keys)]
    with TarWriter(str(tmp_path / "ours.tar")) as writer:
        for sample in samples:
            writer.write(sample)
    reference = io.BytesIO()
    with tarfile.open(fileobj=reference, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for sample in samples:
            for ext in ("jpg", "txt"):
                data = sample[ext] if ext == "jpg" else sample[ext].encode()
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size, info.mode, info.mtime, info.uname, info.gname = len(data), 0o444, 0, "", ""
                tar.addfile(info, io.BytesIO(data))
    assert (tmp_path / "ours.tar").read_bytes() == reference.getvalue()

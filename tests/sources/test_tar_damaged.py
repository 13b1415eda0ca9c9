"""Damaged tar shards are a SourceError naming the shard and the byte offset on every read path,
never fewer or wrong samples; shards as real writers make them still read exactly."""

from __future__ import annotations

import gzip
import io
import os
import pathlib
import re
import subprocess
import tarfile
import uuid

import fsspec
import pytest
import webdataset as wds

import globalloader as gl
from globalloader.errors import SourceError
from globalloader.sources import TarShards, TarWriter
from helpers import damaged_tars

DAMAGED = damaged_tars()


def _match(case: str, url: str) -> str:
    return DAMAGED[case][1].replace("{url}", re.escape(url))


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_local_shard_is_an_error_on_every_read_path(tmp_path: pathlib.Path, case: str) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(DAMAGED[case][0])
    index_dir = tmp_path / "index"
    src = TarShards(str(path), index_dir=index_dir)
    with pytest.raises(SourceError, match=_match(case, str(path))):
        src[0]
    assert not list(index_dir.glob("*.npz"))  # no index of a broken shard, for this job or the next
    with pytest.raises(SourceError, match=_match(case, str(path))):
        list(src.iter_records())
    with pytest.raises(SourceError, match=_match(case, str(path))):
        list(gl.Loader(gl.Dataset.stream(TarShards(str(path))).batch(2), workers=0))
    packed = tmp_path / "shard.tar.gz"
    packed.write_bytes(gzip.compress(DAMAGED[case][0]))
    with pytest.raises(SourceError, match=_match(case, str(packed))):
        list(TarShards(str(packed)).iter_records())


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_shard_read_by_ranged_requests_is_an_error(case: str) -> None:
    """A URL the machine cache does not hold is indexed by block requests and its samples read
    whole when a window shuffle asks (keep_blocks): the same check on that path."""
    url = f"memory://damaged-{uuid.uuid4().hex}/shard.tar"
    with fsspec.open(url, "wb") as out:
        out.write(DAMAGED[case][0])
    src = TarShards(url)
    with pytest.raises(SourceError, match=_match(case, url)):
        list(gl.Loader(gl.Dataset(src).shuffle(seed=1, window=1).batch(2), workers=0))
    with pytest.raises(SourceError, match=_match(case, url)):
        list(src.iter_records())


def _samples(i: int) -> dict[str, bytes]:
    nested = io.BytesIO()  # a tar stored as a field: headers inside a member's data
    with tarfile.open(fileobj=nested, mode="w") as tar:
        info = tarfile.TarInfo("inner.txt")
        info.size = i
        tar.addfile(info, io.BytesIO(b"n" * i))
    return {"bin": bytes(700 * i), "rnd": os.urandom(37 * i), "tar": nested.getvalue(), "txt": b"t" * (i % 2)}


def _write_tarfile(path: pathlib.Path, fmt: int) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        for i in range(5):
            for ext, data in _samples(i).items():
                info = tarfile.TarInfo(f"dir/{'long' * 40 if i == 3 else 'k'}{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _write_webdataset(path: pathlib.Path) -> None:
    with wds.TarWriter(str(path)) as writer:
        for i in range(5):
            writer.write({"__key__": f"k{i}", **_samples(i)})


def _write_own(path: pathlib.Path) -> None:
    with TarWriter(str(path)) as writer:
        for i in range(5):
            writer.write({"__key__": f"k{i}", **_samples(i)})


def _write_gnu_tar(path: pathlib.Path, fmt: str, blocking: int) -> None:
    folder = path.parent / f"files-{path.stem}"
    folder.mkdir()
    names = []
    for i in range(5):
        for ext, data in _samples(i).items():
            (folder / f"k{i}.{ext}").write_bytes(data)
            names.append(f"k{i}.{ext}")
    subprocess.run(
        ["tar", f"--format={fmt}", "-b", str(blocking), "-cf", str(path), "-C", str(folder), *names], check=True
    )


WRITERS = {
    "tarfile gnu": lambda p: _write_tarfile(p, tarfile.GNU_FORMAT),
    "tarfile pax": lambda p: _write_tarfile(p, tarfile.PAX_FORMAT),
    "webdataset TarWriter": _write_webdataset,
    "globalloader TarWriter": _write_own,
    "GNU tar, 10 KiB records": lambda p: _write_gnu_tar(p, "gnu", 20),
    "GNU tar posix, 32 KiB records": lambda p: _write_gnu_tar(p, "posix", 64),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_shards_of_real_writers_read_exactly(tmp_path: pathlib.Path, writer: str) -> None:
    """Their end-of-archive marker is followed by zeros up to the writer's record size, zero bytes
    fill members, and a tar is a field: all valid, the same records webdataset reads."""
    path = tmp_path / "shard.tar"
    WRITERS[writer](path)
    expected = [
        {k: v for k, v in s.items() if k != "__local_path__"} for s in wds.WebDataset(str(path), shardshuffle=False)
    ]
    src = TarShards(str(path))
    assert len(expected) == 5 and [src[i] for i in range(len(src))] == expected
    assert list(src.iter_records()) == expected


def test_an_empty_archive_has_no_samples(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.tar"
    tarfile.open(path, "w").close()
    assert len(path.read_bytes()) == 10240
    assert len(TarShards(str(path))) == 0 and list(TarShards(str(path)).iter_records()) == []

"""A windowed shuffle over tar shards: exact and resumable, and remote shards read whole, once per
epoch, instead of one request per sample."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import fsspec
import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import SourceError
from globalloader.sources import TarShards, TarWriter
from helpers import check_resume


def _remote_shards(name: str, n: int = 28, per_shard: int = 5) -> list[str]:
    with TarWriter(f"memory://{name}/shard-%02d.tar", maxcount=per_shard) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:04d}", "bin": os.urandom(300 + 7 * (i % 50)), "cls": i})
    return writer.paths


def _count_requests(src: TarShards) -> list[tuple[str, int, int]]:
    """Record every remote request the source makes (the real reads still run)."""
    requests: list[tuple[str, int, int]] = []
    read = src._reader.read_remote

    def counted(url: str, start: int, length: int) -> bytes:
        requests.append((url, start, length))
        return read(url, start, length)

    src._reader.read_remote = counted  # type: ignore[method-assign]
    return requests


def test_remote_shards_are_read_whole_once_per_epoch(tmp_path: pathlib.Path) -> None:
    urls = _remote_shards(tmp_path.name)
    reference = TarShards(urls)
    expected = {r["__key__"]: r for r in (reference[i] for i in range(len(reference)))}
    sizes = {url: len(fsspec.filesystem("memory").cat(url)) for url in urls}
    src = TarShards(urls)
    ds = gl.Dataset(src).shuffle(seed=1, window=2)
    assert src.kept_shards == 4 and src.block_starts.tolist() == [0, 5, 10, 15, 20, 25]
    requests = _count_requests(src)
    orders = []
    for epoch in (0, 1):
        before = len(requests)
        records = list(ds.iterator(epoch))
        orders.append([r["__key__"] for r in records])
        assert sorted(orders[-1]) == sorted(expected)  # every sample once
        assert all(r == expected[r["__key__"]] for r in records)  # and its bytes
        made = requests[before:]
        whole = [url for url, start, length in made if start == 0 and length == sizes[url]]
        assert len(set(whole)) == len(whole) <= len(urls)  # each shard read whole once at most
        assert len(made) <= 2 * len(urls)  # shards of 5 samples: one sample alone, then the whole shard
        if epoch == 0:
            assert sorted(whole) == sorted(urls)
    assert orders[0] != sorted(expected) and orders[0] != orders[1]
    # The control: without the window, one request per sample.
    plain = TarShards(urls)
    plain_requests = _count_requests(plain)
    assert len(list(gl.Dataset(plain).shuffle(seed=1).iterator(0))) == 28 and len(plain_requests) == 28


def test_a_plain_shuffle_over_the_same_source_still_reads_sample_by_sample(tmp_path: pathlib.Path) -> None:
    """The source a windowed chain made keep shards serves a plain shuffle too: over many shards,
    no shard gets enough of its samples read close together to be read whole."""
    urls = _remote_shards(tmp_path.name, n=4000, per_shard=40)
    src = TarShards(urls)
    gl.Dataset(src).shuffle(seed=0, window=4)
    assert src.kept_shards == 8
    requests = _count_requests(src)
    assert len(list(gl.Dataset(src).shuffle(seed=3).iterator(0))) == 4000
    assert len(requests) == 4000 and all(start > 0 for _, start, _ in requests)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_windowed_tar_chains_resume_exactly_with_process_workers(
    where: str, tmp_path: pathlib.Path, make_shards: Callable[..., list[str]]
) -> None:
    urls = make_shards(23, per_shard=4) if where == "local" else _remote_shards(tmp_path.name, 23, 4)
    ds = gl.Dataset(TarShards(urls)).shuffle(seed=2, window=2).batch(3)
    full = check_resume(lambda: gl.Loader(ds, workers=2), at=3)
    keys = [k for batch in full for k in batch["__key__"]]
    assert sorted(keys) == sorted(TarShards(urls)[i]["__key__"] for i in range(23))
    assert keys != sorted(keys)


def test_a_remote_shard_that_shrank_is_refused(tmp_path: pathlib.Path) -> None:
    urls = _remote_shards(tmp_path.name, 10, 5)
    src = TarShards(urls)
    ds = gl.Dataset(src).shuffle(seed=0, window=2)
    fs: Any = fsspec.filesystem("memory")
    path = urls[1].removeprefix("memory://")
    fs.pipe(path, fs.cat(path)[:-1024])  # the end of the archive is gone
    with pytest.raises(SourceError, match=f"{urls[1]} is shorter than its index says"):
        list(ds.iterator(0))
    assert np.array_equal(src.block_starts, [0, 5])

"""The shared save/restore/compare check, run against every operator."""

from __future__ import annotations

import numpy as np
import pytest

import globalloader as gl
from helpers import check_resume


def records(n: int) -> list[dict]:
    return [{"__key__": f"s{i}", "x": np.arange(4) + i} for i in range(n)]


def noise(r, rng):
    return {**r, "noise": rng.normal(size=2)}


CHAINS = {
    "source": lambda: gl.Dataset(records(23)),
    "select": lambda: gl.Dataset(records(23)).select(range(20, 2, -1)),
    "shuffle": lambda: gl.Dataset(records(23)).shuffle(5),
    "shard": lambda: gl.Dataset(records(23)).shuffle(5).shard(1, 3),
    "map": lambda: gl.Dataset(records(23)).shuffle(5).map(noise),
    "cache": lambda: gl.Dataset(records(23)).map(lambda r: r).cache().shuffle(1),
    "batch": lambda: gl.Dataset(records(23)).shuffle(5).map(noise).batch(4),
    "batch_drop_last": lambda: gl.Dataset(records(23)).shuffle(5).batch(4, drop_last=True),
    "stream": lambda: gl.Dataset.stream(records(23)),
    "stream_shuffle": lambda: gl.Dataset.stream(records(23)).shuffle(2, buffer_size=5).map(noise),
    "stream_shard_batch": lambda: gl.Dataset.stream(records(23)).shard(0, 2).batch(3),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("at", [0, 1, 3, 7])
def test_every_operator_resumes_exactly(name, at):
    make = CHAINS[name]
    n = len(list(make()))
    check_resume(lambda: make().iterator(epoch=2), min(at, n))


@pytest.mark.parametrize("name", ["batch", "stream_shuffle", "shard"])
def test_every_operator_resumes_in_the_loader(name):
    make = CHAINS[name]
    check_resume(lambda: gl.Loader(make(), workers=2, mode="thread", prefetch=3), 2)

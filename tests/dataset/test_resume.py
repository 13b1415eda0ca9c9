"""The shared save/restore/compare check, run against every operator."""

from __future__ import annotations

import numpy as np
import pytest

import globalloader as gl
from helpers import check_resume, same


def records(n: int) -> list[dict]:
    return [{"__key__": f"s{i}", "x": np.arange(4) + i} for i in range(n)]


def noise(r, rng):
    return {**r, "noise": rng.normal(size=2)}


def docs(n: int) -> list[dict]:
    """Token documents of irregular lengths (0 to 12 tokens)."""
    return [{"__key__": f"d{i}", "tokens": np.arange((i * 7) % 13, dtype=np.int32) + 100 * i} for i in range(n)]


def odd(r) -> bool:
    return int(r["x"][0]) % 2 == 1


def halves(r, rng):
    return [{**r, "half": h, "noise": rng.normal()} for h in range(int(r["x"][0]) % 3)]


def length(r) -> int:
    return len(r["tokens"])


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
    "seed": lambda: gl.Dataset(records(23)).map(noise).seed(3).shuffle(),
    "filter": lambda: gl.Dataset(records(23)).shuffle(5).filter(odd).batch(3),
    "flat_map": lambda: gl.Dataset(records(23)).shuffle(5).flat_map(halves).map(noise).batch(4),
    "stream_filter": lambda: gl.Dataset.stream(records(23)).filter(odd),
    "concat": lambda: gl.Dataset.concat([gl.Dataset(records(5)), gl.Dataset(records(9)).shuffle()]).shuffle(),
    "mix_stop": lambda: gl.Dataset.mix([gl.Dataset(records(20)), gl.Dataset(docs(9))], [0.7, 0.3]).map(noise),
    "mix_cycle": lambda: gl.Dataset.mix(
        [gl.Dataset(records(20)).shuffle(), gl.Dataset(docs(3)).shuffle()], [0.5, 0.5], on_exhausted="cycle"
    ),
    "zip": lambda: gl.Dataset.zip([gl.Dataset(records(23)), gl.Dataset(records(20)).map(noise)]).shuffle(1).batch(3),
    "batch_pad": lambda: gl.Dataset(docs(23)).shuffle(5).batch(4, pad={"tokens": -1}),
    "bucket_batch": lambda: gl.Dataset(docs(23)).shuffle(5).bucket_batch(length, [4, 9], [3, 2, 2], pad=0),
    "pack": lambda: gl.Dataset(docs(23)).shuffle(5).pack(8).batch(2),
    "pack_then_map": lambda: gl.Dataset(docs(23)).filter(lambda d: len(d["tokens"]) != 3).pack(5).map(noise),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("at", [0, 1, 3, 7])
def test_every_operator_resumes_exactly(name, at):
    make = CHAINS[name]
    n = len(list(make()))
    check_resume(lambda: make().iterator(epoch=2), min(at, n))


@pytest.mark.parametrize("name", ["batch", "stream_shuffle", "shard", "filter", "flat_map", "mix_cycle", "pack"])
def test_every_operator_resumes_in_the_loader(name):
    make = CHAINS[name]
    check_resume(lambda: gl.Loader(make(), workers=2, mode="thread", prefetch=3), 2)


@pytest.mark.parametrize("name", ["flat_map", "bucket_batch", "pack_then_map", "zip"])
@pytest.mark.parametrize("at", [1, 4])
def test_tail_operators_resume_with_process_workers(name, at):
    """Process workers send groups of records through shared memory; the tail state is in the
    consumer: a resume anywhere, with prefetched tasks thrown away, continues exactly."""
    make = CHAINS[name]
    full = check_resume(lambda: gl.Loader(make(), workers=2, prefetch=4), at)
    assert same(full, list(make().iterator(epoch=0)))  # the Loader yields what the chain does

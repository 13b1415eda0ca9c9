from __future__ import annotations

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, SampleIndexError, TransformError
from globalloader.sources.sequence import SequenceSource
from helpers import same


def records(n: int) -> list[dict]:
    return [{"__key__": f"s{i}", "x": np.full(3, i, np.int64), "label": i % 5} for i in range(n)]


def keys(ds) -> list[str]:
    return [r["__key__"] for r in ds]


def test_plain_chain_yields_source_in_order():
    assert keys(gl.Dataset(records(5))) == ["s0", "s1", "s2", "s3", "s4"]


def test_select_keeps_given_indices_in_given_order_and_checks_range():
    assert keys(gl.Dataset(records(6)).select([4, 1, 1])) == ["s4", "s1", "s1"]
    with pytest.raises(SampleIndexError, match=r"index 9 .* 6 samples"):
        gl.Dataset(records(6)).select([0, 9])


def test_shuffle_is_a_permutation_that_changes_per_epoch_and_is_reproducible():
    ds = gl.Dataset(records(100)).shuffle(seed=3)
    e0, e1 = keys(ds.iterator(0)), keys(ds.iterator(1))
    assert sorted(e0) == sorted(keys(gl.Dataset(records(100))))
    assert e0 != e1 and e0 != keys(gl.Dataset(records(100)))
    assert e0 == keys(gl.Dataset(records(100)).shuffle(seed=3).iterator(0))
    assert e0 != keys(gl.Dataset(records(100)).shuffle(seed=4).iterator(0))


@pytest.mark.parametrize(("uneven", "lengths"), [("pad", [4, 4, 4]), ("drop", [3, 3, 3]), ("none", [4, 3, 3])])
def test_shard_policies(uneven, lengths):
    shards = [keys(gl.Dataset(records(10)).shuffle(1).shard(r, 3, uneven)) for r in range(3)]
    assert [len(s) for s in shards] == lengths
    seen = [k for s in shards for k in s]
    if uneven == "pad":
        assert set(seen) == {f"s{i}" for i in range(10)} and len(seen) == 12
    elif uneven == "drop":
        assert len(set(seen)) == 9
    else:
        assert sorted(seen) == sorted(f"s{i}" for i in range(10))


def test_shard_rejects_bad_arguments_naming_them():
    ds = gl.Dataset(records(4))
    with pytest.raises(ArgumentError, match="rank"):
        ds.shard(3, 3)
    with pytest.raises(ArgumentError, match="world_size"):
        ds.shard(0, 0)
    with pytest.raises(ArgumentError, match="uneven"):
        ds.shard(0, 2, uneven="wrap")


def test_random_map_rng_depends_on_seed_epoch_and_index_only():
    def noise(r, rng):
        return {**r, "noise": rng.random()}

    ds = gl.Dataset(records(20)).shuffle(7).map(noise)
    by_key = {r["__key__"]: r["noise"] for r in ds.iterator(0)}
    # Same sample, same epoch: same draw whatever the batching or sharding around it.
    sharded = gl.Dataset(records(20)).shuffle(7).shard(1, 2).map(noise).batch(3)
    for batch in sharded.iterator(0):
        for k, v in zip(batch["__key__"], batch["noise"], strict=True):
            assert by_key[k] == v
    assert {r["__key__"]: r["noise"] for r in ds.iterator(1)} != by_key


def test_deterministic_map_gets_no_rng_and_shared_random_map_is_refused():
    assert [r["label"] for r in gl.Dataset(records(3)).map(lambda r: {**r, "label": -1})] == [-1] * 3
    with pytest.raises(ArgumentError, match="shared=True"):
        gl.Dataset(records(3)).map(lambda r, rng: r, shared=True)
    with pytest.raises(ArgumentError, match="before any random map"):
        gl.Dataset(records(3)).map(lambda r, rng: r).map(lambda r: r, shared=True)


def test_batch_collates_arrays_numbers_and_keeps_strings_as_lists():
    batches = list(gl.Dataset(records(5)).batch(2))
    assert len(batches) == 3
    assert batches[0]["x"].shape == (2, 3) and batches[0]["x"].dtype == np.int64
    assert batches[0]["label"].tolist() == [0, 1]
    assert batches[0]["__key__"] == ["s0", "s1"]
    assert batches[2]["x"].shape == (1, 3)
    assert len(list(gl.Dataset(records(5)).batch(2, drop_last=True))) == 2


def test_custom_collate_and_batch_level_map():
    ds = gl.Dataset(records(4)).batch(2, collate=lambda s: [r["label"] for r in s]).map(sum)
    assert list(ds) == [1, 5]


def test_operator_order_errors():
    with pytest.raises(ArgumentError, match="before batch"):
        gl.Dataset(records(4)).batch(2).shuffle(0)
    with pytest.raises(ArgumentError, match="random map"):
        gl.Dataset(records(4)).map(lambda r, rng: r).cache()
    with pytest.raises(ArgumentError, match="batch: n"):
        gl.Dataset(records(4)).batch(0)
    with pytest.raises(ArgumentError, match="len\\(\\) and \\[i\\]"):
        gl.Dataset(42)


def test_map_error_names_map_and_sample():
    def boom(r):
        raise KeyError("label")

    with pytest.raises(TransformError, match="map 'boom' failed on sample index 0 \\(key 's0'\\)"):
        list(gl.Dataset(records(2)).map(boom))


def test_memory_cache_runs_deterministic_prefix_once():
    calls = []

    def slow(r):
        calls.append(r["__key__"])
        return {**r, "y": r["x"] * 2}

    ds = gl.Dataset(records(6)).map(slow).cache().shuffle(0).map(lambda r, rng: {**r, "z": rng.random()})
    first, second = list(ds.iterator(0)), list(ds.iterator(1))
    assert sorted(calls) == sorted(f"s{i}" for i in range(6))
    assert all(same(r["y"], r["x"] * 2) for r in first + second)


class CountingSource(SequenceSource):
    """Records that count their reads: a disk cache hit reads nothing."""

    def __init__(self, seq):
        super().__init__(seq)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def double(r):
    return {**r, "y": r["x"] * 2}


def test_disk_cache_is_shared_between_chains_and_keyed_by_fingerprint(tmp_path):
    first, second = CountingSource(records(4)), CountingSource(records(4))
    list(gl.Dataset(first).map(double).cache(tmp_path))
    again = list(gl.Dataset(second).map(double).cache(tmp_path))
    assert (first.reads, second.reads) == (4, 0) and same(again[3]["y"], np.full(3, 6))

    def triple(r):
        return {**r, "y": r["x"] * 3}

    changed = list(gl.Dataset(gl.from_sequence(records(4))).map(triple).cache(tmp_path))
    assert same(changed[3]["y"], np.full(3, 9)), "a changed transform must not read stale entries"
    with pytest.raises(ArgumentError, match="fingerprint"):
        gl.Dataset(records(4)).cache(tmp_path)


def test_a_damaged_disk_cache_entry_is_computed_again_never_served(tmp_path):
    list(gl.Dataset(CountingSource(records(4))).map(double).cache(tmp_path))
    entries = sorted(tmp_path.rglob("*.pkl"), key=lambda p: int(p.stem))
    intact = [p.read_bytes() for p in entries]
    flipped = bytearray(intact[1])
    flipped[len(flipped) // 2] ^= 0xFF  # inside the array's bytes: unpickles to other numbers
    entries[1].write_bytes(bytes(flipped))
    entries[2].write_bytes(intact[2][: len(intact[2]) // 2])  # cut short
    entries[3].write_bytes(b"")  # renamed before the disk had it
    source = CountingSource(records(4))
    again = list(gl.Dataset(source).map(double).cache(tmp_path))
    assert source.reads == 3 and all(same(r["y"], np.full(3, 2 * i)) for i, r in enumerate(again))
    assert [p.read_bytes() for p in entries] == intact  # written again


def test_stream_buffer_shuffle_and_strided_shard():
    data = records(50)
    stream = gl.Dataset.stream(data).shuffle(seed=1, buffer_size=10)
    out = keys(stream)
    assert sorted(out) == sorted(keys(data)) and out != keys(data)
    assert out == keys(gl.Dataset.stream(data).shuffle(seed=1, buffer_size=10))
    assert keys(stream.iterator(1)) != out
    shards = [keys(gl.Dataset.stream(data).shard(r, 4, uneven="pad")) for r in range(4)]
    assert [len(s) for s in shards] == [13] * 4
    assert {k for s in shards for k in s} == set(keys(data))
    assert [len(keys(gl.Dataset.stream(data).shard(r, 4, uneven="drop"))) for r in range(4)] == [12] * 4


def test_stream_argument_errors():
    with pytest.raises(ArgumentError, match="one-shot iterator"):
        gl.Dataset.stream(iter([1, 2]))
    with pytest.raises(ArgumentError, match="buffer_size"):
        gl.Dataset.stream([1, 2]).shuffle(0)
    with pytest.raises(ArgumentError, match="needs the stream's length"):
        gl.Dataset.stream(lambda: iter(range(5))).shard(0, 2)
    assert list(gl.Dataset.stream(lambda: iter(range(5))).shard(1, 2, uneven="none")) == [1, 3]


def test_map_records_gives_the_records_iteration_gives_for_those_source_indices():
    """An engine that reads the source itself (Ray's map tasks) runs the chain's maps through
    `Plan.map_records`: per epoch, the same records, random streams included, in index order."""

    def split(x, rng):
        return [x * 10 + j + rng.integers(0, 1000) for j in range(x % 3)]

    chain = gl.Dataset(gl.from_sequence(list(range(40)))).map(lambda x: x + 1).filter(lambda x: x % 4).flat_map(split)
    source = chain.source
    for epoch in range(2):
        items = [(i, source[i]) for i in range(40)]
        assert chain.plan.map_records(epoch, items) == list(chain.iterator(epoch))
    maps = gl.Dataset(gl.from_sequence(list(range(10)))).map(lambda x, rng: x + rng.random())
    assert maps.plan.map_records(1, [(7, 7), (2, 2)]) == [list(maps.iterator(1))[7], list(maps.iterator(1))[2]]

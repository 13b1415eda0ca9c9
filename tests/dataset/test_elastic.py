"""Elastic resume: states taken by ranks of world N continue the epoch in ranks of world M.

The oracle is written here from the definition, independently of the library: the epoch's global
order is the unsharded chain's samples; rank r of world W takes the strided share of what remains
(with the "pad"/"drop"/"none" policy); what a rank consumed is removed; the next world shares the
rest. Every case checks each rank's output sample by sample against it.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import StateError

N_SAMPLES = 61


class Blocks:
    """A source made of blocks (as Parquet row groups are), for the windowed shuffle."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.block_starts = n, list(range(0, n, size))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


def tagged(x: Any, rng: np.random.Generator) -> dict[str, Any]:
    return {"i": x, "r": int(rng.integers(1 << 30))}


def base(kind: str) -> gl.Dataset:
    """The chain before shard: its order is the epoch's global order."""
    if kind == "shuffle":
        return gl.Dataset(list(range(N_SAMPLES))).shuffle(7)
    if kind == "window":
        return gl.Dataset(Blocks(N_SAMPLES, 6)).shuffle(seed=3, window=2)
    if kind == "map":
        return gl.Dataset(list(range(N_SAMPLES))).seed(5).shuffle().map(tagged)
    if kind == "mix":
        parts = [gl.Dataset(list(range(40))), gl.Dataset(list(range(1000, 1030))).shuffle(2)]
        return gl.Dataset.mix(parts, [0.6, 0.4]).shuffle(4)
    if kind == "concat":
        return gl.Dataset.concat([gl.Dataset(list(range(30))), gl.Dataset(list(range(500, 531)))]).shuffle(9)
    raise AssertionError(kind)


def chain(kind: str, rank: int, world: int, uneven: str, batch: int | None) -> gl.Dataset:
    ds = base(kind)
    if world > 1 or rank:
        ds = ds.shard(rank, world, uneven)
    return ds if batch is None else ds.batch(batch)


def samples(item: Any, batch: int | None) -> list[Any]:
    """The samples of an item (a batch or a sample), as comparable Python values."""
    if batch is None:
        return [_value(item)]
    if isinstance(item, dict):
        return [_value({k: v[j] for k, v in item.items()}) for j in range(len(item["i"]))]
    return [_value(x) for x in item]


def _value(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, int(v)) for k, v in x.items()))
    return int(x)


def share(remaining: list[int], rank: int, world: int, uneven: str) -> list[int]:
    """The positions of `remaining` that rank `rank` takes: every world-th from its rank, the
    "pad" tail wrapping around to the start (docs/sharding.md)."""
    m = len(remaining)
    count = {"pad": -(-m // world) if m else 0, "drop": m // world, "none": len(range(rank, m, world))}[uneven]
    return [remaining[(rank + q * world) % m] for q in range(count)]


class Runner:
    """A DatasetIterator or a Loader (threads or processes) over one rank's chain, epoch 1."""

    def __init__(self, how: str, ds: gl.Dataset, state: Any) -> None:
        self.loader = None
        if how == "iter":
            self.obj: Any = ds.iterator(epoch=1)
        else:
            self.obj = self.loader = gl.Loader(ds, workers=2, mode=how, prefetch=3)
            self.loader.set_epoch(1)
        if state is not None:
            self.obj.load_state_dict(state)
        self.it = iter(self.obj)

    def take(self, k: int | None) -> list[Any]:
        if k is None:
            return list(self.it)
        return [next(self.it) for _ in range(k)]

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


def run_case(kind: str, uneven: str, stages: list[dict[str, Any]], how: str) -> None:
    """Each stage: world, batch size, lockstep or not, items taken per rank (None: to the end).

    A world that loads one state of the same world size (ranks in lockstep) at a whole batch goes
    on in the same shares; otherwise what the earlier world consumed is removed from the order and
    the new world shares out the rest."""
    order = [s for item in chain(kind, 0, 1, uneven, None).iterator(epoch=1) for s in samples(item, None)]
    remaining = list(range(len(order)))  # global positions the current shares are cut from
    counts: list[int] = []  # samples each rank consumed of its current share
    states: Any = None
    seen: list[Any] = []
    for stage in stages:
        world, batch, takes = stage["world"], stage["batch"], stage["takes"]
        going_on = isinstance(states, dict) and len(counts) == world and (batch is None or counts[0] % batch == 0)
        if not going_on:
            consumed = {p for r, c in enumerate(counts) for p in share(remaining, r, len(counts), uneven)[:c]}
            remaining = [p for p in remaining if p not in consumed]
            counts = [0] * world
        new_states = []
        for rank in range(world):
            runner = Runner(how, chain(kind, rank, world, uneven, batch), states)
            items = runner.take(takes[rank])
            got = [s for item in items for s in samples(item, batch)]
            mine = share(remaining, rank, world, uneven)[counts[rank] :]
            assert got == [order[p] for p in mine[: len(got)]], f"{kind} world {world} rank {rank}: not the order"
            if takes[rank] is None:
                assert len(got) == len(mine), f"{kind} world {world} rank {rank}: stopped early"
            counts[rank] += len(got)
            seen.extend(got)
            new_states.append(json.loads(json.dumps(runner.obj.state_dict())))  # JSON-able, as checkpointed
            runner.close()
        states = new_states if not stage["lockstep"] else new_states[stage["from_rank"]]
    if uneven == "none":
        assert Counter(seen) == Counter(order), "not every sample of the epoch exactly once"


def _cases() -> list[tuple[Any, ...]]:
    """A fixed random table: world N -> M (-> K), checkpoint points, chain, policy, runner."""
    rng = random.Random(21)
    cases = []
    for case in range(36):
        kind = rng.choice(["shuffle", "window", "map", "mix", "concat"])
        uneven = rng.choice(["none", "none", "pad", "drop"])
        how = "process" if case % 9 == 4 else "thread" if case % 3 == 1 else "iter"
        worlds = [rng.randint(1, 5) for _ in range(rng.choice([2, 2, 3]))]
        batched = rng.random() < 0.7  # the batch size may change between worlds; batch() may not go away
        stages = []
        for k, world in enumerate(worlds):
            last = k == len(worlds) - 1
            batch = rng.choice([3, 4, 8]) if batched else None
            lockstep = rng.random() < 0.5
            # keep every stage's takes well within a share (N_SAMPLES spread over at most 3 stages)
            most = max(1, N_SAMPLES // (4 * world * (batch or 1)))
            if last:
                takes: list[int | None] = [None] * world
            elif lockstep:
                takes = [rng.randint(0, most)] * world
            else:
                takes = [rng.randint(0, most) for _ in range(world)]
            stages.append(
                {
                    "world": world,
                    "batch": batch,
                    "takes": takes,
                    "lockstep": lockstep,
                    "from_rank": rng.randrange(world),
                }
            )
        path = "-".join(f"{s['world']}{'L' if s['lockstep'] else 'A'}b{s['batch']}" for s in stages)
        cases.append(pytest.param(kind, uneven, how, stages, id=f"{case}-{kind}-{uneven}-{how}-{path}"))
    return cases


@pytest.mark.parametrize(("kind", "uneven", "how", "stages"), _cases())
def test_elastic_table(kind, uneven, how, stages):
    run_case(kind, uneven, stages, how)


# -- chains whose records do not follow from sample positions (filter, flat_map, pack, bucket_batch)


def docs(n: int) -> list[dict[str, Any]]:
    """Token documents of 0 to 12 tokens; token values name their document (100 * i + j)."""
    return [{"__key__": f"d{i}", "tokens": np.arange((i * 7) % 13, dtype=np.int32) + 100 * i} for i in range(n)]


def odd(d: dict[str, Any]) -> bool:
    return int(d["__key__"][1:]) % 2 == 1


def copies(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**d, "copy": np.int64(c)} for c in range(int(d["__key__"][1:]) % 3)]


PADDED = {"tokens": -1}
TAILS = {
    "filter": (lambda ds: ds.filter(odd).batch(3, pad=PADDED), lambda d: [d["__key__"]] if odd(d) else []),
    "flat_map": (
        lambda ds: ds.flat_map(copies).batch(4, pad=PADDED),
        lambda d: [(d["__key__"], c["copy"]) for c in copies(d)],
    ),
    "pack": (lambda ds: ds.pack(8, pad=-1), lambda d: d["tokens"].tolist()),
    "bucket_batch": (
        lambda ds: ds.bucket_batch(lambda d: len(d["tokens"]), [4, 9], [3, 2, 2], pad=0),
        lambda d: [d["__key__"]],
    ),
}


def tail_records(kind: str, item: Any) -> list[Any]:
    """What an output holds, in the units the oracle counts (keys, (key, copy) pairs, tokens)."""
    if kind == "pack":
        return [int(t) for t in item["tokens"] if t != -1]
    if kind == "flat_map":
        return list(zip(item["__key__"], item["copy"].tolist(), strict=True))
    return list(item["__key__"])


def tail_chain(kind: str, rank: int, world: int) -> gl.Dataset:
    return TAILS[kind][0](gl.Dataset(docs(47)).shuffle(7).shard(rank, world, "none"))


@pytest.mark.parametrize("kind", sorted(TAILS))
@pytest.mark.parametrize(("old", "new", "takes"), [(4, 2, [1, 1, 0, 1]), (2, 3, [1, 2]), (3, 3, [1, 0, 2])])
def test_tail_chains_yield_every_record_once_from_every_ranks_state(kind, old, new, takes):
    """The list of every old rank's state: every sample is fed to exactly one rank, and what an old
    rank held in its tail (a partial batch or row, filling buckets) is yielded by new rank
    old_rank % new, flushed as at the end of an epoch; so every record appears exactly once."""
    expected = Counter(r for d in docs(47) for r in TAILS[kind][1](d))
    seen: Counter[Any] = Counter()
    states = []
    for rank in range(old):
        loader = gl.Loader(tail_chain(kind, rank, old), workers=2, mode="thread")
        it = iter(loader)
        for _ in range(takes[rank]):
            seen.update(tail_records(kind, next(it)))
        states.append(loader.state_dict())
        loader.close()
    for rank in range(new):
        it = tail_chain(kind, rank, new).iterator()
        it.load_state_dict(states)
        for item in it:
            seen.update(tail_records(kind, item))
    assert seen == expected


def test_tail_chain_refuses_one_rank_state_for_another_world():
    it = tail_chain("pack", 0, 2).iterator()
    next(it)
    with pytest.raises(StateError, match="load the list of every rank's state"):
        tail_chain("pack", 1, 3).iterator().load_state_dict(it.state_dict())


# -- what is refused, and how


def test_another_chain_is_refused_naming_what_differs():
    it = gl.Dataset(list(range(40))).seed(1).shuffle().map(tagged).shard(0, 4).batch(4).iterator()
    next(it)
    state = it.state_dict()
    others = {
        "the root seed": gl.Dataset(list(range(40))).seed(2).shuffle().map(tagged),
        "the source": gl.Dataset(list(range(41))).seed(1).shuffle().map(tagged),
        "the index operators": gl.Dataset(list(range(40))).seed(1).select(range(39, -1, -1)).shuffle().map(tagged),
        "the maps": gl.Dataset(list(range(40))).seed(1).shuffle().map(lambda x: {"i": x}),
    }
    for part, ds in others.items():
        with pytest.raises(StateError, match=part):
            ds.shard(1, 2).batch(4).iterator().load_state_dict(state)
    with pytest.raises(StateError, match="drop_last"):
        gl.Dataset(list(range(40))).seed(1).shuffle().map(tagged).shard(1, 2).batch(
            4, drop_last=True
        ).iterator().load_state_dict(state)


def test_index_operators_after_shard_and_streams_are_refused_for_another_world():
    it = gl.Dataset(list(range(40))).shuffle(1).shard(0, 2).select(range(5)).iterator()
    next(it)
    with pytest.raises(StateError, match="shard\\(\\) to be the last index operator"):
        gl.Dataset(list(range(40))).shuffle(1).shard(1, 2).select(range(5)).iterator().load_state_dict(it.state_dict())
    stream = gl.Dataset.stream(list(range(40))).shard(0, 2).iterator()
    next(stream)
    with pytest.raises(StateError, match="random-access source"):
        gl.Dataset.stream(list(range(40))).shard(1, 2).iterator().load_state_dict(stream.state_dict())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("task", 10**9, "'task' = 1000000000 is out of range"),
        ("task", 11, "'task' = 11 is out of range"),
        ("offset", 1, "'offset' = 1 is out of range"),
        ("task", -1, "'task' must be an int >= 0"),
        ("epoch", True, "'epoch' must be an int >= 0"),
        ("offset", "2", "'offset' must be an int >= 0"),
    ],
)
def test_a_state_out_of_range_is_refused_naming_the_field(field, value, message):
    ds = gl.Dataset(list(range(40))).shuffle(1).batch(4)  # 10 tasks
    it = ds.iterator()
    next(it)
    state = {**it.state_dict(), field: value}
    for target in (ds.iterator(), gl.Loader(ds)):
        with pytest.raises(StateError, match=message):
            target.load_state_dict(state)
    end = {**it.state_dict(), "task": 10}  # the end of the epoch is a position too
    assert list(_loaded(ds.iterator(), end)) == []


def test_an_unbatched_offset_past_its_task_is_refused():
    ds = gl.Dataset(list(range(40))).shuffle(1)  # tasks of 32 samples: 32 and 8
    it = ds.iterator()
    next(it)
    with pytest.raises(StateError, match="'offset' = 8 is out of range: task 1 holds 8 samples"):
        ds.iterator().load_state_dict({**it.state_dict(), "task": 1, "offset": 8})
    assert [int(x) for x in _loaded(ds.iterator(), {**it.state_dict(), "task": 1, "offset": 7})] == list(ds.iterator())[
        39:
    ]


def _loaded(obj: Any, state: Any) -> Any:
    obj.load_state_dict(state)
    return obj


# -- batch size, state size, the next epoch


def test_a_changed_batch_size_continues_at_the_same_sample_position():
    """batch(32) -> batch(64): at a whole number of 64-sample batches the rest is exactly an
    uninterrupted batch(64) run's; elsewhere every sample is still seen once, in order, and the
    batches are cut from the resume point (the first one holds the next 64 samples)."""

    def ds(rank: int, world: int, size: int) -> gl.Dataset:
        return gl.Dataset(list(range(1000))).shuffle(3).shard(rank, world, "none").batch(size)

    whole = ds(0, 2, 64).iterator()
    wanted = list(whole)
    for taken, world in [(4, 2), (3, 2), (3, 4)]:  # 128 samples per rank: whole; 96: not whole
        it = ds(0, world, 32).iterator()
        head = [next(it) for _ in range(taken)]
        rest = list(_loaded(ds(0, 2, 64).iterator(), it.state_dict()))
        if world == 2 and taken * 32 % 64 == 0:
            assert all(np.array_equal(a, b) for a, b in zip(rest, wanted[taken // 2 :], strict=True))
        flat = np.concatenate(rest)
        assert [len(b) for b in rest[:-1]] == [64] * (len(rest) - 1)
        order = np.concatenate(list(gl.Dataset(list(range(1000))).shuffle(3).batch(1000)))
        consumed = {p for r in range(world) for p in range(r, world * taken * 32, world)}
        remaining = [order[p] for p in range(1000) if p not in consumed]
        assert flat.tolist() == remaining[0::2]
        assert np.concatenate(head).tolist() == order[0 : world * taken * 32 : world].tolist()


def test_states_are_small_and_json_through_changes_of_world():
    def ds(rank: int, world: int) -> gl.Dataset:
        return gl.Dataset(list(range(100_000))).shuffle(3).map(tagged).shard(rank, world).batch(32)

    states: Any = None
    for world in (64, 48, 8):
        new = []
        for rank in range(world):
            it = ds(rank, world).iterator()
            if states is not None:
                it.load_state_dict(states)
            for _ in range(5 + (rank % 3 == 0)):  # ranks out of step: every third took a batch more
                next(it)
            new.append(json.loads(json.dumps(it.state_dict())))
        states = new
        assert max(len(json.dumps(s)) for s in states) < 2048


def test_the_next_epoch_is_a_whole_epoch_at_the_new_world_size():
    def ds(rank: int, world: int) -> gl.Dataset:
        return gl.Dataset(list(range(50))).shuffle(3).shard(rank, world, "none").batch(4)

    old = gl.Loader(ds(1, 4))
    old.set_epoch(2)
    it = iter(old)
    next(it)
    new = gl.Loader(ds(0, 3), workers=2, mode="thread")
    new.load_state_dict(old.state_dict())
    list(new)  # the rest of epoch 2
    fresh = gl.Loader(ds(0, 3))
    fresh.set_epoch(3)
    assert all(np.array_equal(a, b) for a, b in zip(list(new), list(fresh), strict=True))
    new.close()


def test_a_finished_epoch_resumes_at_the_next_one():
    def ds(rank: int, world: int) -> gl.Dataset:
        return gl.Dataset(list(range(50))).shuffle(3).shard(rank, world, "drop").batch(4)

    states = []
    for rank in range(4):
        it = ds(rank, 4).iterator(epoch=0)
        list(it)  # 12 samples each; 2 dropped
        states.append(it.state_dict())
    it = ds(0, 3).iterator()
    it.load_state_dict(states)
    assert it.epoch == 1
    assert all(np.array_equal(a, b) for a, b in zip(it, ds(0, 3).iterator(epoch=1), strict=True))


# -- real files: Parquet row groups and tar shards, windowed shuffle, process workers


@pytest.mark.parametrize("kind", ["parquet", "tar"])
def test_real_files_with_a_windowed_shuffle_continue_in_another_world(tmp_path, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        pq.write_table(pa.table({"id": np.arange(150)}), tmp_path / "rows.parquet", row_group_size=20)
        source = gl.Parquet(str(tmp_path / "rows.parquet"))
    else:
        with gl.TarWriter(str(tmp_path / "shard-%02d.tar"), maxcount=25) as writer:
            for i in range(150):
                writer.write({"__key__": f"s{i:04d}", "id": i})
        source = gl.TarShards(str(tmp_path / "shard-{00..05}.tar"))

    def ids(batch: Any) -> list[int]:
        return [int(i) for i in batch["id"]]

    def ds(rank: int, world: int) -> gl.Dataset:
        chain = gl.Dataset(source).shuffle(seed=4, window=2)
        if kind == "tar":
            chain = chain.map(lambda r: {"id": int(r["id"])})
        return chain.shard(rank, world, "none").batch(5)

    order = [i for batch in ds(0, 1).iterator() for i in ids(batch)]
    states, seen, consumed = [], [], set()
    for rank, taken in enumerate([4, 1, 6]):  # ranks out of step
        loader = gl.Loader(ds(rank, 3), workers=2)
        it = iter(loader)
        got = [i for _ in range(taken) for i in ids(next(it))]
        assert got == order[rank::3][: len(got)]
        consumed.update(range(rank, 3 * len(got), 3)[: len(got)])
        seen += got
        states.append(loader.state_dict())
        loader.close()
    remaining = [i for p, i in enumerate(order) if p not in consumed]
    for rank in range(2):
        with gl.Loader(ds(rank, 2), workers=2) as loader:
            loader.load_state_dict(states)
            got = [i for batch in loader for i in ids(batch)]
        assert got == remaining[rank::2]
        seen += got
    assert sorted(seen) == list(range(150))


# -- pack resumed at another batch size: rows go on filling, batches keep their shape


def long_docs(n: int) -> list[dict[str, Any]]:
    """Documents of 0 to 40 tokens: one may fill several rows, and several batches, at once."""
    return [{"tokens": np.arange((i * 11) % 41, dtype=np.int32) + 1000 * i} for i in range(n)]


def packed(rank: int, world: int, size: int) -> gl.Dataset:
    return gl.Dataset(long_docs(60)).shuffle(7).shard(rank, world, "none").pack(8, pad=-1).batch(size)


@pytest.mark.parametrize(("old", "new"), [(1, 1), (2, 2), (2, 1), (3, 2)])
@pytest.mark.parametrize("taken", [1, 2, 5])
def test_pack_resumed_at_another_batch_size_keeps_the_batch_shape(old, new, taken):
    """batch(2) -> batch(3): the row pack was filling, and the rows a partial batch held, go on
    filling this chain's rows and batches (before, the partial row came out as a padded batch of
    one row mid-epoch); every batch but each rank's last has the full shape, every token once."""
    seen: Counter[int] = Counter()
    states = []
    for rank in range(old):
        it = packed(rank, old, 2).iterator()
        for _ in range(taken):
            seen.update(tokens(next(it)))
        states.append(it.state_dict())
    for rank in range(new):
        it = packed(rank, new, 3).iterator()
        it.load_state_dict(states if old > 1 else states[0])
        rest = list(it)
        assert all(b["tokens"].shape == (3, 8) for b in rest[:-1]), [b["tokens"].shape for b in rest]
        for b in rest:
            seen.update(tokens(b))
    assert seen == Counter(int(t) for d in long_docs(60) for t in d["tokens"])


def tokens(batch: Any) -> list[int]:
    return [int(t) for t in np.asarray(batch["tokens"]).ravel() if t != -1]

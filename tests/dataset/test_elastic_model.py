"""Elastic resume against a plain model, over random worlds (1..64), checkpoints, batch sizes and
uneven policies, through several changes of world in one epoch.

The model is written here from the definition, independently of the library: the epoch's global
order is the unsharded chain's; rank r of world W takes the strided positions r, r + W, ... of
what remains (the "pad" tail wrapping to the start, "drop" cutting it); a rank consumed the
samples of the batches it took, and at the end of its share all of it (a short last batch holds
fewer; drop_last drops the rest); ranks in lockstep took the same number of batches, so one
rank's state says what each consumed. A new world removes what the old one consumed and shares
out the rest, except that the same world, loading one state whose ranks each stand at a whole
batch or at the end of their share, goes on in its shares. Each rank's output is checked sample
by sample against the model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import globalloader as gl
from globalloader.errors import StateError

POLICIES = ("none", "pad", "drop")


def share(m: int, rank: int, world: int, uneven: str) -> list[int]:
    """Positions (into what remains, of length m) that rank `rank` of `world` takes."""
    count = {"pad": -(-m // world) if m else 0, "drop": m // world, "none": len(range(rank, m, world))}[uneven]
    return [(rank + q * world) % m for q in range(count)]


def cut(positions: list[int], size: int, drop_last: bool) -> list[list[int]]:
    batches = [positions[i : i + size] for i in range(0, len(positions), size)]
    return [b for b in batches if len(b) == size] if drop_last else batches


@dataclass
class Model:
    """What remains of the epoch (global positions) and what each rank of the current world consumed."""

    remaining: list[int]
    world: int = 1
    uneven: str = "none"
    counts: list[int] = field(default_factory=lambda: [0])

    def shares(self) -> list[list[int]]:
        return [share(len(self.remaining), r, self.world, self.uneven) for r in range(self.world)]

    def new_world(self, world: int, uneven: str) -> None:
        gone = {self.remaining[p] for r, s in enumerate(self.shares()) for p in s[: self.counts[r]]}
        self.remaining = [g for g in self.remaining if g not in gone]
        self.world, self.uneven, self.counts = world, uneven, [0] * world


def chain(n: int, rank: int, world: int, uneven: str, size: int, drop_last: bool) -> gl.Dataset:
    return gl.Dataset(list(range(n))).shuffle(5).shard(rank, world, uneven).batch(size, drop_last=drop_last)


def run(n: int, drop_last: bool, stages: list[dict[str, Any]]) -> None:
    """Each stage: world, uneven, batch size, and either one `steps` for every rank (lockstep, the
    state of `from_rank` stands for all) or `steps` per rank (every rank's state); the last stage
    runs to the end of the epoch."""
    order = [int(i) for b in gl.Dataset(list(range(n))).shuffle(5).batch(max(n, 1)).iterator(epoch=1) for i in b]
    model, states = Model(list(range(n))), None
    seen: list[int] = []
    policies: set[str] = set()  # of the worlds that ran
    for k, stage in enumerate(stages):
        world, uneven, size = stage["world"], stage["uneven"], stage["size"]
        last = k == len(stages) - 1
        if states is not None:
            shares = [len(s) for s in model.shares()]
            if model.counts == shares:  # the old world finished the epoch: the next one is whole
                it = chain(n, 0, world, uneven, size, drop_last).iterator()
                it.load_state_dict(states)
                assert it.epoch == 2 or not list(it)  # the next epoch, or the end of this one
                break
        same = (world, uneven) == (model.world, model.uneven) and isinstance(states, dict)
        ends = [len(s) for s in model.shares()]
        if not (same and all(c % size == 0 or c == e for c, e in zip(model.counts, ends, strict=True))):
            model.new_world(world, uneven)
        shares = model.shares()
        batches = [cut(s[c:], size, drop_last) for s, c in zip(shares, model.counts, strict=True)]
        lockstep = stage["lockstep"] and not last
        fewest = min(len(b) for b in batches)
        new_states = []
        for rank in range(world):
            it = chain(n, rank, world, uneven, size, drop_last).iterator(epoch=1)
            if states is not None:
                it.load_state_dict(states)
            if last:
                wanted, got = batches[rank], [[int(i) for i in b] for b in it]
            else:
                wanted = batches[rank][: stage["steps_fraction"] * fewest // 4 if lockstep else stage["steps"][rank]]
                got = [[int(i) for i in next(it)] for _ in range(len(wanted))]
            assert got == [[order[model.remaining[p]] for p in b] for b in wanted], f"stage {k} rank {rank}"
            seen += [i for b in got for i in b]
            ended = len(got) == len(batches[rank])
            model.counts[rank] = len(shares[rank]) if ended else model.counts[rank] + len(got) * size
            new_states.append(it.state_dict())
        policies.add(uneven)
        states = new_states[stage["from_rank"] % world] if lockstep else new_states
    if "pad" not in policies:
        assert max(Counter(seen).values(), default=1) == 1, "a sample twice without padding"
    if "drop" not in policies and not drop_last:
        assert set(seen) == set(order), "a sample left out without a drop policy"


stage_strategy = st.fixed_dictionaries(
    {
        "world": st.integers(1, 64),
        "uneven": st.sampled_from(POLICIES),
        "size": st.integers(1, 5),
        "lockstep": st.booleans(),
        "steps_fraction": st.integers(0, 4),  # lockstep: that many quarters of the fewest batches
        "from_rank": st.integers(0, 63),
        "steps": st.lists(st.integers(0, 6), min_size=64, max_size=64),
    }
)


def _stage(world: int, uneven: str, size: int, steps: list[int] | None = None, lockstep: bool = False) -> dict:
    return {
        "world": world,
        "uneven": uneven,
        "size": size,
        "lockstep": lockstep,
        "steps_fraction": 2,
        "from_rank": 0,
        "steps": (steps or []) + [1] * (64 - len(steps or [])),
    }


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 90), drop_last=st.booleans(), stages=st.lists(stage_strategy, min_size=1, max_size=4))
@example(n=10, drop_last=False, stages=[_stage(3, "none", 2, [1, 9, 1]), _stage(2, "none", 2)])
@example(n=10, drop_last=False, stages=[_stage(3, "pad", 2, [1, 9, 1]), _stage(2, "pad", 2)])
@example(
    n=10,
    drop_last=False,
    stages=[
        _stage(3, "pad", 2, [1, 9, 1]),
        _stage(64, "pad", 2, [0, 1] * 32),
        _stage(5, "pad", 3, [2] * 5),
        _stage(2, "pad", 2),
    ],
)
@example(n=10, drop_last=True, stages=[_stage(3, "none", 2, [0, 9, 1]), _stage(2, "drop", 3)])
@example(n=23, drop_last=False, stages=[_stage(4, "none", 2, [3], lockstep=True), _stage(3, "none", 4)])
def test_elastic_resume_matches_the_model(n, drop_last, stages):
    run(n, drop_last, stages)


def test_a_rank_that_ended_with_a_short_batch_counts_only_its_samples():
    """The issue's case: 10 samples over 3 ranks in batches of 2; rank 1 runs to its end (3
    samples: a batch of 2 and one of 1), ranks 0 and 2 take one batch; their 3 states continue in
    2 ranks, and every sample comes exactly once."""
    seen, states = [], []
    for rank, steps in enumerate([1, None, 1]):
        it = chain(10, rank, 3, "none", 2, False).iterator()
        got = list(it) if steps is None else [next(it)]
        seen += [int(i) for b in got for i in b]
        states.append(it.state_dict())
    assert states[1]["samples"] == 3
    for rank in range(2):
        it = chain(10, rank, 2, "none", 2, False).iterator()
        it.load_state_dict(states)
        seen += [int(i) for b in it for i in np.asarray(b)]
    assert sorted(seen) == list(range(10))


# -- hostile states: a mutated state loads to the model's continuation, or is a StateError


def continuation(n: int, state: dict[str, Any], rank: int, world: int, exact: bool) -> list[int]:
    """What the model says rank `rank` of `world` (batches of 2, uneven "none") yields after
    loading `state` (`exact`: into the chain it was taken from)."""
    epoch, size = state["epoch"], 2
    order = [int(i) for b in gl.Dataset(list(range(n))).shuffle(5).batch(max(n, 1)).iterator(epoch=epoch) for i in b]
    model = Model(list(range(n)))
    for layer in state.get("base") or []:
        model.world, model.uneven = layer["world"], layer["uneven"]
        model.counts = [c for c, times in layer["counts"] for _ in range(times)]
        model.new_world(world, "none")
    if exact:
        start = state["task"] * size
    else:
        _, old_world, old_uneven = state["shard"]
        model.world, model.uneven = old_world, old_uneven
        shares = [len(s) for s in model.shares()]
        steps, old_size = state["task"], state["batch_size"]
        model.counts = [min(m, steps * old_size) for m in shares]  # lockstep: as many batches
        if model.counts == shares:  # the old world had finished: the next epoch, whole
            return [int(i) for b in chain(n, rank, world, "none", size, False).iterator(epoch=epoch + 1) for i in b]
        same = (old_world, old_uneven) == (world, "none")
        if not (same and all(c % size == 0 or c == m for c, m in zip(model.counts, shares, strict=True))):
            model.new_world(world, "none")
        start = model.counts[rank] if model.world == world and model.counts != [0] * world else 0
    mine = share(len(model.remaining), rank, world, "none")[start:]
    return [order[model.remaining[p]] for p in mine]


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 25),
    st.integers(min_value=1 << 62, max_value=1 << 80),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.lists(st.integers(-2, 25), max_size=4),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from(
        [[1, 3, "none"], [0, 2, "pad"], [2, 3, "drop"], [{"world": 2, "counts": [[1, 2]], "uneven": "none"}], []]
    ),
)
FIELDS = ("fingerprint", "epoch", "task", "offset", "samples", "batch_size", "shard", "chain", "base", "consumed")


@settings(max_examples=150, deadline=None)
@given(
    field_name=st.sampled_from((*FIELDS, "tail", "extra")),
    delete=st.booleans(),
    value=values,
    element=st.sampled_from([None, 0, 1, 2]),
)
def test_a_mutated_state_loads_to_the_models_continuation_or_is_refused(field_name, delete, value, element):
    n = 20
    it = chain(n, 1, 3, "none", 2, False).iterator(epoch=1)
    next(it), next(it)
    state = it.state_dict()
    if delete and field_name in state:
        del state[field_name]
    elif element is not None and isinstance(state.get(field_name), list) and element < len(state[field_name]):
        state[field_name] = [value if i == element else v for i, v in enumerate(state[field_name])]
    else:
        state[field_name] = value
    for rank, world in ((1, 3), (0, 3), (0, 2)):
        it = chain(n, rank, world, "none", 2, False).iterator(epoch=1)
        exact = state.get("fingerprint") == it.state_dict()["fingerprint"]
        try:
            it.load_state_dict(state)
        except StateError:
            continue
        got = [int(i) for b in it for i in b]
        assert got == continuation(n, state, rank, world, exact), (field_name, state.get(field_name), rank, world)

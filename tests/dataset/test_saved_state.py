"""Hostile and malformed state dicts: each is a StateError naming the field at fault, raised before
anything is computed or allocated from it, in the same chain and in another world."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import StateError


def chain(rank: int, world: int) -> gl.Dataset:
    return gl.Dataset(list(range(20))).shuffle(1).shard(rank, world, "none").batch(2)


def saved(rank: int = 0, world: int = 2, batches: int = 1) -> dict[str, Any]:
    it = chain(rank, world).iterator()
    for _ in range(batches):
        next(it)
    return it.state_dict()


def refused(state: Any, match: str, targets: tuple[tuple[int, int], ...] = ((0, 2), (1, 2), (0, 3))) -> None:
    """`state` is refused naming `match`, in the chain it came from, another rank and another world."""
    for rank, world in targets:
        for target in (chain(rank, world).iterator(), gl.Loader(chain(rank, world))):
            with pytest.raises(StateError, match=match):
                target.load_state_dict(state)


def test_samples_past_the_share_are_refused_not_taken_as_the_end():
    """Before, 11 samples of a 10-sample share loaded as "that rank finished", so the other ranks
    skipped to the next epoch."""
    refused({**saved(), "samples": 11}, "'samples'")
    refused([{**saved(r), "samples": 11 if r == 0 else 2} for r in range(2)], "'samples'", ((0, 3),))


def test_samples_that_disagree_with_the_position_are_refused_in_another_world():
    refused({**saved(batches=2), "samples": 2}, "'samples' = 2 does not match its position", ((1, 2), (0, 3)))


def test_a_missing_field_is_named():
    for name in ("samples", "fingerprint", "epoch", "task", "offset"):
        state = saved()
        del state[name]
        refused(state, f"missing field '{name}'")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("shard", [0, 10**12, "none"], "'shard': world_size must be an int in \\[1, 1048576\\]"),
        ("shard", [2, 2, "none"], "'shard': rank must be an int in \\[0, 1\\]"),
        ("shard", ["0", 2, "none"], "'shard': rank"),
        ("shard", [0, 2, "wrap"], "'shard' must be \\[rank, world_size, uneven\\]"),
        ("shard", [0, 2], "'shard' must be"),
        ("batch_size", 0, "'batch_size' must be an int >= 1"),
        ("batch_size", 2.0, "'batch_size'"),
        ("epoch", 1 << 70, "'epoch' must be an int >= 0"),
        ("fingerprint", 7, "'fingerprint' must be a str"),
        ("chain", ["a"], "'chain' must map"),
        ("consumed", [1.5], "'consumed' must be a list of sample indices"),
        ("consumed", [10**6], "'consumed' holds an index outside \\[0, 20\\)"),
        ("base", {"world": 2}, "'base' must be a list"),
        ("base", [{"world": 10**12, "counts": [[0, 10**12]], "uneven": "none"}], "'base': a layer's world"),
        ("base", [{"world": 4, "counts": [[0, 3]], "uneven": "none"}], "'base' holds a layer whose counts"),
        ("base", [{"world": 2, "counts": [[-1, 2]], "uneven": "none"}], "'base': a count"),
        ("base", [{"taken": [99]}], "'base' holds an index outside"),
        ("tail", {"stages": []}, "'tail'"),
    ],
)
def test_a_malformed_field_is_refused_naming_it(field, value, match):
    refused({**saved(), field: value}, match)


def test_a_list_naming_a_world_of_10_to_the_12_ranks_is_refused_without_allocating_it():
    """Before, a world of 10**12 ranks in a list of states was a MemoryError (a list of every rank)."""
    states = [{**saved(r), "shard": [r, 10**12, "none"]} for r in range(2)]
    refused(states, "world_size must be an int in")


# -- chains with a tail (pack, filter, ...): the tail carries records


def docs(n: int) -> list[dict[str, Any]]:
    return [{"tokens": np.arange((i * 7) % 13, dtype=np.int32) + 100 * i} for i in range(n)]


def pack_chain(rank: int, world: int, size: int = 2) -> gl.Dataset:
    return gl.Dataset(docs(47)).shuffle(7).shard(rank, world, "none").pack(8, pad=-1).batch(size)


def tokens(batches: list[Any]) -> Counter[int]:
    return Counter(int(t) for b in batches for t in np.asarray(b["tokens"]).ravel() if t != -1)


def test_a_pack_state_without_its_tail_is_refused_not_its_records_dropped():
    """Before, a rank's state whose `tail` was removed loaded into another world, and the tokens
    its partial row held were never yielded."""
    states = []
    for rank in range(2):
        it = pack_chain(rank, 2).iterator()
        next(it)
        states.append(it.state_dict())
    assert any(s["tail"]["stages"][0] for s in states), "a rank holds a partial row"
    del states[0]["tail"]
    for target in (pack_chain(0, 3).iterator(), pack_chain(0, 2).iterator(), pack_chain(0, 2, 3).iterator()):
        with pytest.raises(StateError, match="'tail' is missing"):
            target.load_state_dict(states)


# A tail state of the form saved_state checks: each case below breaks one thing in it, so that
# what refuses it is the check of that thing (a stage's own restore, the tail's), not the form's.
WELL_FORMED: dict[str, Any] = {"stages": [[], []], "queues": [[], []], "out": [], "flushed": False, "flushed_stages": 0}


@pytest.mark.parametrize(
    "tail",
    [
        {**WELL_FORMED, "stages": [[np.zeros((2, 2), dtype=np.int32)], []]},  # a 2-D piece
        {**WELL_FORMED, "stages": [[np.arange(9)], []]},  # a row of 9 in rows of 8
        {**WELL_FORMED, "stages": [[], [None, None]]},  # a full batch held
        {**WELL_FORMED, "stages": [[]]},  # an operator missing
        {**WELL_FORMED, "queues": [[]]},  # an operator's queue missing
        {**WELL_FORMED, "flushed_stages": 3},  # more operators flushed than the chain has
        {**WELL_FORMED, "out": ()},
        {**WELL_FORMED, "flushed": "no"},
        {"stages": [[], []], "out": [], "flushed": False},  # no queues, no flushed_stages
    ],
)
def test_a_tail_that_does_not_fit_the_chain_is_refused(tail):
    states = []
    for rank in range(2):
        it = pack_chain(rank, 2).iterator()
        next(it)
        states.append(copy.deepcopy(it.state_dict()))
    states[0]["tail"] = tail
    for target, state in ((pack_chain(0, 2).iterator(), states[0]), (pack_chain(0, 3).iterator(), states)):
        with pytest.raises(StateError, match="tail"):
            target.load_state_dict(state)


def bucket_chain(rank: int, world: int) -> gl.Dataset:
    return (
        gl.Dataset(docs(47))
        .shuffle(7)
        .shard(rank, world, "none")
        .bucket_batch(lambda d: len(d["tokens"]), [4, 9], 2, pad=0)
    )


@pytest.mark.parametrize("buckets", [[[], [{"tokens": np.arange(5)}] * 2, []], [[], []]])  # a full bucket; one missing
def test_buckets_that_do_not_fit_the_chain_are_refused(buckets):
    """BucketStage.restore's check: a bucket holding a whole batch, or buckets of another count."""
    states = []
    for rank in range(2):
        it = bucket_chain(rank, 2).iterator()
        next(it)
        states.append(copy.deepcopy(it.state_dict()))
    states[0]["tail"]["stages"] = [buckets]
    for target, state in ((bucket_chain(0, 2).iterator(), states[0]), (bucket_chain(0, 3).iterator(), states)):
        with pytest.raises(StateError, match="tail state does not fit this chain: buckets of"):
            target.load_state_dict(state)

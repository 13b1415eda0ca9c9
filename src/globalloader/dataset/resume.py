"""The state dict of a pass over an epoch: what it holds, how a loaded one is checked, and how a
state taken by any rank of any world size continues the epoch here (elastic resume).

A state holds the position (epoch, task, offset), exact for this very chain, and the batch size
it counts in; the chain's identity (`fingerprint`, and digested part by part in `chain`, so that
a refusal names what differs); the rank and world size of its `shard` and how many samples of its
share it consumed (`samples`). Its form is checked field by field first (`dataset.saved_state`).

Loaded into the same chain at the same rank, it is the exact resume of before, after a range check.
Loaded into another rank, world size or batch size, it goes through the epoch's global order (the
positions before `shard`, `sampling.elastic`): what the old world consumed is removed from it and
this rank takes its strided share of the rest, in order. One state stands for every rank when the
ranks were in lockstep; the list of every rank's state covers ranks out of step. What the old
world consumed (the `base`) stays in the states of the rest of the epoch, so the world may change
again; the next epoch is a whole one.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from globalloader.dataset.fingerprint import digest
from globalloader.dataset.index_plan import IndexPlan
from globalloader.dataset.plan import Plan
from globalloader.dataset.saved_state import Base, SavedState, Taken, read_states
from globalloader.dataset.tail import Tail
from globalloader.errors import StateError
from globalloader.sampling.elastic import Layer, Remaining
from globalloader.sampling.sharding import shard_positions

_PART_NAMES = {
    "seed": "the root seed (seed())",
    "source": "the source (its files or records)",
    "index": "the index operators (select, shuffle)",
    "maps": "the maps, filters or flat_maps (their functions or the values they read)",
    "batch": "batch()'s drop_last or collate",
    "batch_maps": "the maps after batch()",
    "tail": "pack, bucket_batch or the operators after a filter or flat_map",
}
_DIGESTS: weakref.WeakKeyDictionary[Plan, dict[str, str]] = weakref.WeakKeyDictionary()
_ORDERS: weakref.WeakKeyDictionary[Plan, OrderedDict[tuple[int, Base | None], EpochOrder]] = weakref.WeakKeyDictionary()


class Position(NamedTuple):
    """Where a pass is, or where a loaded state puts the next one: `task` and `offset` (items
    taken from it) count in this rank's share of what `base` left; a pass whose order is not the
    seed's (shared mode) names the samples it `consumed` instead (task = offset = 0); a chain with
    a tail adds the tail's state."""

    epoch: int
    task: int = 0
    offset: int = 0
    consumed: list[int] | None = None
    tail: dict[str, Any] | None = None
    base: Base | None = None  # what other worlds consumed of this epoch


def chain_digests(plan: Plan) -> dict[str, str]:
    """The chain's identity by part, leaving out what an elastic resume may change: the shard
    (where it is, at the end of the index operators, is checked on loading) and the batch size."""
    cached = _DIGESTS.get(plan)
    if cached is None:
        parts = dict(plan.resume_parts)
        parts["index"] = plan.order_identity(placed=False)
        parts["batch"] = None if parts["batch"] is None else parts["batch"][1:]
        parts["tail"] = [(name, ident[1:] if name == "BatchOp" else ident) for name, ident in parts["tail"]]
        cached = _DIGESTS[plan] = {k: digest(v)[:12] for k, v in parts.items()}
    return cached


class EpochOrder:
    """This rank's share of an epoch that starts from `base` (None: the whole epoch): how many
    samples, and the source indices of any run of its positions. `after`: an order whose base
    is a prefix of `base`, whose remaining positions are taken over instead of recomputed.
    Build them with `epoch_order`, which keeps the last few: loading a state and the run after
    it need the same one."""

    def __init__(self, plan: Plan, epoch: int, base: Base | None = None, after: EpochOrder | None = None) -> None:
        self.plan, self.epoch, self.base = plan, epoch, base
        self.length: int | None = plan.samples
        self.remaining: Remaining | None = None  # what the earlier worlds left of the global order
        if base is None:
            return
        indexed = positional(plan)
        self._ops, self._shard = indexed.shard()
        uneven = "pad" if self._shard is None else self._shard.uneven
        total = indexed.lengths[self._ops]
        done = 0
        if after is not None and after.remaining is not None and after.base is not None:
            self.remaining, done = after.remaining.copy(), len(after.base.steps)
            assert base.steps[:done] == after.base.steps, "`after` starts from another base"
        else:
            self.remaining = Remaining(total)
        remaining = self.remaining
        for step in base.steps[done:]:
            if isinstance(step, Layer):
                remaining.consume(step)
            else:
                sources = indexed.map_positions(remaining.positions(np.arange(len(remaining))), epoch, self._ops)
                remaining.drop(without(sources, step.indices))
        shard = self._shard
        self.length = len(remaining) if shard is None else remaining.share(shard.rank, shard.world_size, uneven)

    def num_tasks(self) -> int | None:
        return None if self.length is None else self.plan.tasks_for(self.length)

    def task_items(self, task: int) -> npt.NDArray[np.int64] | None:
        """Source indices of task `task`; None for a whole epoch (the worker maps them itself)."""
        if self.base is None:
            return None
        assert self.length is not None
        start = task * self.plan.task_size
        return self.indices(start, min(start + self.plan.task_size, self.length))

    def indices(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.int64]:
        """Source indices of this rank's positions [start, stop)."""
        plan = positional(self.plan)
        if self.base is None:
            return plan.indices(self.epoch, start, stop)
        assert self.remaining is not None and self.length is not None
        stop = self.length if stop is None else stop
        local = np.arange(start, stop, dtype=np.int64)
        if self._shard is not None:
            local = shard_positions(local, len(self.remaining), self._shard.rank, self._shard.world_size)
        return plan.map_positions(self.remaining.positions(local), self.epoch, self._ops)


def positional(plan: Plan) -> IndexPlan:
    """`plan`, whose positions an order maps: never a stream's (its state loads only into the
    same chain, rank and world size, and names no consumed samples)."""
    assert isinstance(plan, IndexPlan), "a stream's records have no positions to map"
    return plan


def epoch_order(plan: Plan, epoch: int, base: Base | None = None, after: EpochOrder | None = None) -> EpochOrder:
    """An `EpochOrder`, kept (the last few per plan): O(n) to build for ranks out of step, and a
    load, its range check and the run after it ask for the same one. Orders never change once built."""
    kept = _ORDERS.setdefault(plan, OrderedDict())
    order = kept.pop((epoch, base), None) or EpochOrder(plan, epoch, base, after)
    kept[(epoch, base)] = order
    while len(kept) > 4:
        kept.popitem(last=False)
    return order


def make_state(plan: Plan, position: Position) -> dict[str, Any]:
    epoch, task, offset, consumed, tail, base = position
    shard = plan.shard()[1]
    rank, world, uneven = (0, 1, "none") if shard is None else (shard.rank, shard.world_size, shard.uneven)
    samples = task * plan.task_size + offset
    if not plan.is_stream:
        share = epoch_order(plan, epoch, base).length
        assert share is not None, "a random-access chain knows its length"
        samples = _consumed(plan, task, offset, plan.task_size, share)
    return SavedState(
        fingerprint=plan.resume_fingerprint,
        epoch=epoch,
        task=task,
        offset=offset,
        samples=samples,
        batch_size=_batch_size(plan),
        rank=rank,
        world=world,
        uneven=uneven,
        chain=dict(chain_digests(plan)),
        tail=tail,
        base=base,
        consumed=None if consumed is None else tuple(int(i) for i in consumed),
    ).to_json()


def _batch_size(plan: Plan) -> int | None:
    return None if plan.batch is None else plan.batch.size


def _consumed(plan: Plan, task: int, offset: int, size: int, share: int, ended: bool = False) -> int:
    """The samples of a rank's share of `share` consumed at position (task, offset), in tasks of
    `size` (a batch size, or the unbatched task size): a short last batch counts the samples it
    held, and the end of the share all of it (with drop_last the rest is dropped there, as at the
    end of any epoch). StateError when the position lies beyond the share's end, unless `ended`
    (another rank's share, which ended before that many steps)."""
    drop_last = plan.batch is not None and plan.batch.drop_last
    end = share // size if drop_last else -(-share // size)
    beyond = task > end or (task == end and offset)
    if (beyond and not ended) or (plan.batch is not None and offset):
        raise StateError(
            f"state dict fields 'task' = {task}, 'offset' = {offset} lie beyond the end of the rank's share "
            f"({share} samples in tasks of {size})"
        )
    return share if task >= end else min(task * size + offset, share)


def load_state(plan: Plan, state: Any) -> Position:
    """Where a state dict (or the list of every rank's) puts the next pass of `plan`; StateError
    naming the field or the part of the chain at fault, before anything is built from it."""
    states = read_states(state, plan.source_length)
    for s in states:
        _check_tail(plan, s)
    if len(states) == 1 and states[0].fingerprint == plan.resume_fingerprint:
        return _exact(plan, states[0])
    return _elastic(plan, states)


def _check_tail(plan: Plan, state: SavedState) -> None:
    """A state holds its tail exactly when the chain has one and the pass had begun: a tail
    missing from a begun state would drop the records it held."""
    if state.tail is not None and not plan.grouped:
        raise StateError("state dict was taken from a different chain (it has a 'tail', this chain's operators none)")
    if state.tail is None and plan.grouped and state.started:
        raise StateError(
            "state dict field 'tail' is missing: this chain's tail operators (filter, flat_map, pack, "
            "bucket_batch) hold records that the state must carry"
        )


def _exact(plan: Plan, state: SavedState) -> Position:
    epoch, task, offset, consumed = state.epoch, state.task, state.offset, state.consumed
    if state.batch_size != _batch_size(plan):
        raise StateError(
            f"state dict field 'batch_size' = {state.batch_size} does not match the chain's ({_batch_size(plan)})"
        )
    if state.tail is not None:
        Tail(plan.tail, plan.seed, epoch, state.tail)  # refuses a tail state that does not fit
    if consumed is None and not plan.is_stream:  # a stream's length is not known: checked as it is read
        order = epoch_order(plan, epoch, state.base)
        _check_range(plan, order, task, offset)
        assert order.length is not None, "a random-access chain knows its length"
        if state.samples > order.length:  # the position alone resumes this very chain
            raise StateError(
                f"state dict field 'samples' = {state.samples} is beyond this rank's share ({order.length} samples)"
            )
    return Position(epoch, task, offset, None if consumed is None else list(consumed), state.tail, state.base)


def check_samples(state: SavedState, expected: int) -> None:
    """StateError unless `state` counts `expected` samples for its position (an edited state)."""
    if state.samples != expected:
        raise StateError(
            f"state dict field 'samples' = {state.samples} does not match its position (task {state.task}, "
            f"offset {state.offset}: {expected} samples of the rank's share); was the state edited?"
        )


def _check_range(plan: Plan, order: EpochOrder, task: int, offset: int) -> None:
    tasks, size = order.num_tasks(), plan.task_size
    assert tasks is not None and order.length is not None, "a random-access chain knows its length"
    if task > tasks or (task == tasks and offset):
        raise StateError(
            f"state dict field 'task' = {task} is out of range: this rank's epoch has {tasks} tasks "
            f"({order.length} samples); was the state taken from another chain?"
        )
    in_task = min(size, order.length - task * size)
    most = in_task if plan.grouped else 0 if plan.batch is not None else in_task - 1
    if offset > max(most, 0):
        raise StateError(
            f"state dict field 'offset' = {offset} is out of range: task {task} holds {in_task} samples "
            f"(at most {max(most, 0)} may have been taken)"
        )


def _elastic(plan: Plan, states: list[SavedState]) -> Position:
    """A state (ranks in lockstep) or every rank's, from another rank, world or batch size."""
    if plan.is_stream:
        raise StateError(
            "a stream's state loads only into the same chain, rank and world size "
            "(elastic resume needs a random-access source)"
        )
    check_same_chain(chain_digests(plan), states)
    indexed = positional(plan)
    ops, shard = indexed.shard()
    if ops < len(indexed.index_ops) - 1:
        after = ", ".join(str(op.describe()[0]) for op in indexed.index_ops[ops + 1 :])
        raise StateError(f"elastic resume needs shard() to be the last index operator, but {after} follows it")
    states = one_checkpoint(states)
    epoch, world, old_uneven = states[0].epoch, states[0].world, states[0].uneven
    base = states[0].base or Base(())
    shared = [s.consumed is not None for s in states]
    if len(states) == 1 and world > 1 and (plan.grouped or shared[0]):
        why = "its records do not follow from sample positions" if plan.grouped else "it was fed in shared mode"
        raise StateError(
            f"this chain's state from rank {states[0].rank} of {world} cannot stand for the other ranks "
            f"({why}): load the list of every rank's state"
        )
    if any(shared) and not all(shared):
        raise StateError("the states mix shared mode (consumed sets) and local positions: give one run's states")
    start = epoch_order(plan, epoch, base)
    before = start.remaining  # what remained when the old world started
    assert before is not None
    shares = [before.share(r, world, old_uneven) for r in range(world)]
    if all(shared):
        taken = [i for s in states for i in s.consumed or ()]
        step: Layer | Taken = Taken(tuple(taken))
        done = len(taken) >= sum(shares)
    else:
        counts = _counts(plan, states, shares)
        step = Layer(world, tuple(counts), old_uneven)
        done = counts == shares
    rank, new_world = (0, 1) if shard is None else (shard.rank, shard.world_size)
    held = _handed_over(plan, epoch, states, rank, new_world) if plan.grouped else None
    if done and (held is None or not held.holds()):
        return Position(epoch + 1)  # the old world had finished this epoch: the next one is whole
    same_world = (world, old_uneven) == ((1, "none") if shard is None else (shard.world_size, shard.uneven))
    if same_world and len(states) == 1 and not plan.grouped and isinstance(step, Layer):
        # Another rank, or another batch size, of the same world in lockstep: every rank goes on
        # in its own share, exactly as if it had been its own state (and as the rank it came from
        # does), when each stands at a whole batch or at the end of its share; otherwise what
        # remains is shared out afresh (below), by every rank alike.
        ended = [c == n for c, n in zip(step.counts, shares, strict=True)]
        if plan.batch is None or all(e or c % plan.task_size == 0 for c, e in zip(step.counts, ended, strict=True)):
            order = epoch_order(plan, epoch, base if base.steps else None)
            task, offset = (order.num_tasks() or 0, 0) if ended[rank] else divmod(step.counts[rank], plan.task_size)
            _check_range(plan, order, task, offset)
            return Position(epoch, task, offset, None, None, order.base)
    order = epoch_order(plan, epoch, Base((*base.steps, step)), start)
    return Position(epoch, 0, 0, None, None if held is None else held.state(), order.base)


def one_checkpoint(states: list[SavedState]) -> list[SavedState]:
    """`states` by rank, if they stand for one checkpoint: one state (ranks in lockstep), or every
    rank's of one world at one point; else a StateError saying what to give."""
    if len({(s.epoch, s.base, s.world, s.uneven) for s in states}) > 1:
        raise StateError(
            f"the states were taken at different points (epochs {sorted({s.epoch for s in states})}, "
            f"shards {sorted({(s.world, s.uneven) for s in states})}): "
            "give the states every rank saved at the same checkpoint"
        )
    world, ranks = states[0].world, sorted(s.rank for s in states)
    if len(states) > 1 and ranks != list(range(world)):
        raise StateError(
            f"got the states of ranks {ranks} of a world of {world}: load one state (ranks in lockstep) "
            f"or the list of all {world}"
        )
    return sorted(states, key=lambda s: s.rank)


def _counts(plan: Plan, states: list[SavedState], shares: list[int]) -> list[int]:
    """The samples each old rank consumed of its share: its own state's `samples` (checked against
    its position), or, for one state standing for ranks in lockstep, what each rank's share gives
    after as many steps (batches of the state's batch size): ranks' shares may differ by one."""
    for s in states:
        check_samples(s, _consumed(plan, s.task, s.offset, _steps_size(plan, s), shares[s.rank]))
    if len(states) > 1:
        return [s.samples for s in states]
    s = states[0]
    return [_consumed(plan, s.task, s.offset, _steps_size(plan, s), share, ended=True) for share in shares]


def _steps_size(plan: Plan, state: SavedState) -> int:
    """The size of the tasks `state`'s position counts in: its batch size (which may differ from
    this chain's), or the unbatched task size."""
    if (state.batch_size is None) != (plan.batch is None):
        raise StateError(
            f"state dict field 'batch_size' = {state.batch_size} does not fit this chain "
            f"({'un' if plan.batch is None else ''}batched)"
        )
    return plan.task_size if state.batch_size is None else state.batch_size


def _handed_over(plan: Plan, epoch: int, states: list[SavedState], rank: int, world: int) -> Tail:
    """A tail holding what old ranks rank, rank + world, ... held in their tails: the records
    they made and had not yielded, and what their operators held or had waiting (a partial packed
    row, a partial batch, filling buckets), fed again to this chain's operators, which go on
    filling them: every record the old world made is yielded once, in batches of this chain's size."""
    tail = Tail(plan.tail, plan.seed, epoch)
    for old_rank, state in enumerate(states):
        if old_rank % world == rank and state.tail is not None:
            tail.absorb(Tail(plan.tail, plan.seed, epoch, state.tail))
    return tail


def check_same_chain(ours: dict[str, str], states: list[SavedState]) -> None:
    """StateError naming the parts of the chain (`ours`, digested by part) that a state's differ in."""
    for state in states:
        differ = [_PART_NAMES.get(k, k) for k in ours if state.chain.get(k) != ours[k]]
        if differ:
            raise StateError(f"state dict was taken from a different chain: {'; '.join(differ)} differ")


def without(sources: npt.NDArray[np.int64], taken: Sequence[int]) -> npt.NDArray[np.bool_]:
    """Flags keeping `sources` minus `taken` as multisets (earliest occurrences go first)."""
    keep = np.ones(len(sources), dtype=bool)
    if not taken or not len(sources):
        return keep
    order = np.argsort(sources, kind="stable")
    ordered = sources[order]
    occurrence = np.arange(len(ordered)) - np.searchsorted(ordered, ordered, side="left")
    values, counts = np.unique(np.asarray(taken, dtype=np.int64), return_counts=True)
    at = np.minimum(np.searchsorted(values, ordered), len(values) - 1)
    allowed = np.where(values[at] == ordered, counts[at], 0)
    keep[order[occurrence < allowed]] = False
    return keep

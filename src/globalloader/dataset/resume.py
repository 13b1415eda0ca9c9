"""The state dict of a pass over an epoch: what it holds, how a loaded one is checked, and how a
state taken by any rank of any world size continues the epoch here (elastic resume).

A state holds the position (epoch, task, offset), exact for this very chain; the chain's identity
(`fingerprint`, and digested part by part in `chain`, so that a refusal names what differs); the
rank and world size of its `shard` and how many samples of its share it consumed (`samples`).

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
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from globalloader.dataset.fingerprint import digest
from globalloader.dataset.index_ops import Shard
from globalloader.dataset.plan import Plan
from globalloader.dataset.tail import Tail
from globalloader.errors import StateError
from globalloader.sampling.elastic import Layer, Remaining
from globalloader.sampling.sharding import UNEVEN_POLICIES, shard_positions

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


@dataclass(frozen=True)
class Taken:
    """Source indices consumed by ranks in shared mode (their order is not the seed's)."""

    indices: tuple[int, ...]


@dataclass(frozen=True)
class Base:
    """What earlier worlds consumed of this epoch, in the order they did."""

    steps: tuple[Layer | Taken, ...]

    def to_json(self) -> list[Any]:
        return [s.to_json() if isinstance(s, Layer) else {"taken": list(s.indices)} for s in self.steps]

    @classmethod
    def from_json(cls, value: Any) -> Base:
        if not isinstance(value, list):
            raise StateError(f"state dict field 'base' must be a list, got {type(value).__name__}")
        steps: list[Layer | Taken] = []
        for step in value:
            if isinstance(step, dict) and "taken" in step:
                steps.append(Taken(tuple(_indices(step["taken"], "base"))))
            else:
                steps.append(Layer.from_json(step))
        return cls(tuple(steps))


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


def _shard(plan: Plan) -> tuple[int, Shard | None]:
    """The number of index operators before `shard` (they make the epoch's global order) and it."""
    for k, op in enumerate(plan.index_ops):
        if isinstance(op, Shard):
            return k, op
    return len(plan.index_ops), None


def chain_digests(plan: Plan) -> dict[str, str]:
    """The chain's identity by part, leaving out what an elastic resume may change: the shard
    (where it is, at the end of the index operators, is checked on loading) and the batch size."""
    cached = _DIGESTS.get(plan)
    if cached is None:
        parts = dict(plan.resume_parts)
        index = zip(plan.index_ops, parts["index"], strict=True)
        parts["index"] = [d for op, d in index if not isinstance(op, Shard)]
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
        self._ops, self._shard = _shard(plan)
        uneven = "pad" if self._shard is None else self._shard.uneven
        total = plan.lengths[self._ops]
        assert total is not None, "elastic resume is refused for streams"
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
                sources = plan.map_positions(remaining.positions(np.arange(len(remaining))), epoch, self._ops)
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
        if self.base is None:
            return self.plan.indices(self.epoch, start, stop)
        assert self.remaining is not None and self.length is not None
        stop = self.length if stop is None else stop
        local = np.arange(start, stop, dtype=np.int64)
        if self._shard is not None:
            local = shard_positions(local, len(self.remaining), self._shard.rank, self._shard.world_size)
        return self.plan.map_positions(self.remaining.positions(local), self.epoch, self._ops)


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
    _, shard = _shard(plan)
    state: dict[str, Any] = {
        "fingerprint": plan.resume_fingerprint,
        "epoch": epoch,
        "task": task,
        "offset": offset,
        "samples": task * plan.task_size + offset,
        "shard": [0, 1, "none"] if shard is None else [shard.rank, shard.world_size, shard.uneven],
        "chain": chain_digests(plan),
    }
    if tail is not None:
        state["tail"] = tail
    if base is not None:
        state["base"] = base.to_json()
    if consumed is not None:
        state["consumed"] = [int(i) for i in consumed]
    return state


def load_state(plan: Plan, state: Any) -> Position:
    """Where a state dict (or the list of every rank's) puts the next pass of `plan`; StateError
    naming the field or the part of the chain at fault."""
    states = state if isinstance(state, list) else [state]
    if not states or not all(isinstance(s, dict) for s in states):
        raise StateError(f"expected a state dict or the list of every rank's state dicts, got {state!r:.200}")
    for s in states:
        _check_fields(s)
    if len(states) == 1 and states[0]["fingerprint"] == plan.resume_fingerprint:
        return _exact(plan, states[0])
    return _elastic(plan, states)


def _check_fields(state: dict[str, Any]) -> None:
    missing = [k for k in ("fingerprint", "epoch", "task", "offset") if k not in state]
    if missing:
        raise StateError(f"not a globalloader state dict (missing {missing[0]!r}): {state!r:.200}")
    for name in ("epoch", "task", "offset", "samples"):
        value = state.get(name, 0)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise StateError(f"state dict field {name!r} must be an int >= 0, got {value!r:.100}")


def _exact(plan: Plan, state: dict[str, Any]) -> Position:
    epoch, task, offset = int(state["epoch"]), int(state["task"]), int(state["offset"])
    tail, consumed = state.get("tail"), state.get("consumed")
    if (tail is not None) != plan.grouped and (tail is not None or task or offset):
        raise StateError("state dict was taken from a different chain (its tail operators differ)")
    base = None if state.get("base") is None else Base.from_json(state["base"])
    if consumed is not None:
        consumed = _indices(consumed, "consumed", plan.source_length)
    elif not plan.is_stream:  # a stream's length is not known: its position is checked as it is read
        _check_range(plan, epoch_order(plan, epoch, base), task, offset)
    return Position(epoch, task, offset, consumed, tail, base)


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


def _elastic(plan: Plan, states: list[dict[str, Any]]) -> Position:
    """A state (ranks in lockstep) or every rank's, from another rank, world or batch size."""
    if plan.is_stream:
        raise StateError(
            "a stream's state loads only into the same chain, rank and world size "
            "(elastic resume needs a random-access source)"
        )
    _check_same_chain(plan, states)
    ops, shard = _shard(plan)
    if ops < len(plan.index_ops) - 1:
        after = ", ".join(str(op.describe()[0]) for op in plan.index_ops[ops + 1 :])
        raise StateError(f"elastic resume needs shard() to be the last index operator, but {after} follows it")
    epochs = {int(s["epoch"]) for s in states}
    bases = {repr(s.get("base")) for s in states}
    worlds = {_rank_world(s)[1:] for s in states}
    if len(epochs) > 1 or len(bases) > 1 or len(worlds) > 1:
        raise StateError(
            f"the states were taken at different points (epochs {sorted(epochs)}, shards {sorted(worlds)}): "
            "give the states every rank saved at the same checkpoint"
        )
    epoch, (world, old_uneven) = epochs.pop(), worlds.pop()
    base = Base(()) if states[0].get("base") is None else Base.from_json(states[0]["base"])
    shared = [s.get("consumed") is not None for s in states]
    if len(states) == 1 and world > 1 and (plan.grouped or shared[0]):
        why = "its records do not follow from sample positions" if plan.grouped else "it was fed in shared mode"
        raise StateError(
            f"this chain's state from rank {_rank_world(states[0])[0]} of {world} cannot stand for the other ranks "
            f"({why}): load the list of every rank's state"
        )
    if len(states) > 1:
        ranks = sorted(_rank_world(s)[0] for s in states)
        if ranks != list(range(world)):
            raise StateError(
                f"got the states of ranks {ranks} of a world of {world}: load one state (ranks in lockstep) "
                f"or the list of all {world}"
            )
        states = sorted(states, key=lambda s: _rank_world(s)[0])
    if any(shared) and not all(shared):
        raise StateError("the states mix shared mode (consumed sets) and local positions: give one run's states")
    start = epoch_order(plan, epoch, base)
    before = start.remaining  # what remained when the old world started
    assert before is not None
    if all(shared):
        taken = [i for s in states for i in _indices(s["consumed"], "consumed", plan.source_length)]
        step: Layer | Taken = Taken(tuple(taken))
        done = len(taken) >= sum(before.share(r, world, old_uneven) for r in range(world))
    else:
        samples = [int(s["samples"]) for s in states]
        counts = samples * world if len(states) == 1 else samples
        step = Layer(world, tuple(counts), old_uneven)
        done = all(c >= before.share(r, world, old_uneven) for r, c in enumerate(counts))
    if done:  # the old world had finished this epoch: the next one is whole
        return Position(epoch + 1)
    same_world = (world, old_uneven) == ((1, "none") if shard is None else (shard.world_size, shard.uneven))
    if same_world and isinstance(step, Layer) and len(states) == 1 and not plan.grouped:
        # Another rank, or another batch size, of the same world in lockstep: this rank's own
        # position in the same share (exactly as if it had been this rank's state), when it falls
        # on a whole batch; otherwise what remains is shared out from here (below).
        task, offset = divmod(step.counts[0], plan.task_size)
        if plan.batch is None or not offset:
            order = epoch_order(plan, epoch, base if base.steps else None)
            _check_range(plan, order, task, offset)
            return Position(epoch, task, offset, None, None, order.base)
    order = epoch_order(plan, epoch, Base((*base.steps, step)), start)  # checks the counts against the shares
    tail = None
    if plan.grouped:
        rank, new_world = (0, 1) if shard is None else (shard.rank, shard.world_size)
        tail = _handed_over(plan, epoch, states, rank, new_world)
    return Position(epoch, 0, 0, None, tail, order.base)


def _handed_over(plan: Plan, epoch: int, states: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """A fresh tail state whose pending outputs are what old ranks rank, rank + world, ... held in
    their tails, flushed as at the end of an epoch (a short batch, a padded row; none with
    drop_last): every record the old world made is yielded once."""
    outputs: list[Any] = []
    for old_rank, state in enumerate(states):
        if old_rank % world == rank and state.get("tail") is not None:
            held = Tail(plan.tail, plan.seed, epoch, state["tail"])
            held.flush()
            outputs.extend(held.out)
    fresh = Tail(plan.tail, plan.seed, epoch).state()
    return {**fresh, "out": outputs}


def _check_same_chain(plan: Plan, states: list[dict[str, Any]]) -> None:
    ours = chain_digests(plan)
    for state in states:
        theirs = state.get("chain")
        if not isinstance(theirs, dict):
            raise StateError(
                "state dict was taken from a different chain (source, operators, functions or values they read "
                f"changed): fingerprint {state['fingerprint']} != {plan.resume_fingerprint}"
            )
        differ = [_PART_NAMES.get(k, k) for k in ours if theirs.get(k) != ours[k]]
        if differ:
            raise StateError(f"state dict was taken from a different chain: {'; '.join(differ)} differ")


def _rank_world(state: dict[str, Any]) -> tuple[int, int, str]:
    """The (rank, world size, uneven policy) of the shard a state was taken from."""
    value = state.get("shard", [0, 1, "none"])
    try:
        rank, world, uneven = int(value[0]), int(value[1]), str(value[2])
        if not 0 <= rank < world or uneven not in UNEVEN_POLICIES:
            raise ValueError("rank or uneven out of range")
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise StateError(f"state dict field 'shard' must be [rank, world_size, uneven], got {value!r:.100}") from exc
    return rank, world, uneven


def _indices(value: Any, field: str, bound: int | None = None) -> list[int]:
    try:
        arr = np.asarray(value, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StateError(f"state dict field {field!r} must be a list of sample indices: {exc}") from exc
    if arr.size and (arr.min() < 0 or (bound is not None and arr.max() >= bound)):
        raise StateError(f"state dict field {field!r} holds an index outside [0, {bound}) ")
    return arr.tolist()


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

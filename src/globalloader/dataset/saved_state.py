"""The form of a Loader's state dict: every field, its type and its range, written and checked in
one place, so that a malformed or hostile state is a StateError naming the field before anything
is computed, allocated or resumed from it (`dataset.resume` says what a well-formed state means).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from globalloader.errors import StateError
from globalloader.sampling.elastic import Layer, state_int
from globalloader.sampling.sharding import MAX_WORLD_SIZE, UNEVEN_POLICIES


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
    def from_json(cls, value: Any, source_length: int | None) -> Base:
        if not isinstance(value, list):
            raise StateError(f"state dict field 'base' must be a list, got {type(value).__name__}")
        steps: list[Layer | Taken] = []
        for step in value:
            if isinstance(step, dict) and "taken" in step:
                steps.append(Taken(tuple(indices(step["taken"], "base", source_length))))
            else:
                steps.append(Layer.from_json(step))
        return cls(tuple(steps))


@dataclass(frozen=True)
class SavedState:
    """One rank's state dict, checked: a position (`epoch`, `task`, `offset`) in this rank's share
    of what `base` left, the `samples` of that share it consumed, the `batch_size` it was taken
    with (None: unbatched), the chain's identity (`fingerprint`, `chain` by part), its shard
    (`rank`, `world`, `uneven`), and, when present, the tail's records and the shared-mode
    consumed set."""

    fingerprint: str
    epoch: int
    task: int
    offset: int
    samples: int
    batch_size: int | None
    rank: int
    world: int
    uneven: str
    chain: dict[str, str]
    tail: dict[str, Any] | None = None
    base: Base | None = None
    consumed: tuple[int, ...] | None = None

    @property
    def started(self) -> bool:
        """Past the start of the epoch (a state at the start holds no tail)."""
        return bool(self.task or self.offset or self.samples or self.consumed)

    def to_json(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "task": self.task,
            "offset": self.offset,
            "samples": self.samples,
            "batch_size": self.batch_size,
            "shard": [self.rank, self.world, self.uneven],
            "chain": self.chain,
        }
        if self.tail is not None:
            state["tail"] = self.tail
        if self.base is not None:
            state["base"] = self.base.to_json()
        if self.consumed is not None:
            state["consumed"] = list(self.consumed)
        return state

    @classmethod
    def from_json(cls, state: Any, source_length: int | None) -> SavedState:
        """`state` checked field by field (unknown fields are ignored), or a StateError naming the
        first field at fault; `source_length` bounds the sample indices it names."""
        if not isinstance(state, dict):
            raise StateError(f"expected a state dict or the list of every rank's state dicts, got {state!r:.200}")
        missing = [k for k in _REQUIRED if k not in state]
        if missing:
            raise StateError(f"not a globalloader state dict (missing field {missing[0]!r}): {state!r:.200}")
        if not isinstance(state["fingerprint"], str):
            raise StateError(f"state dict field 'fingerprint' must be a str, got {state['fingerprint']!r:.100}")
        batch_size = state["batch_size"]
        rank, world, uneven = _shard(state["shard"])
        return cls(
            fingerprint=state["fingerprint"],
            epoch=state_int(state["epoch"], "epoch"),
            task=state_int(state["task"], "task"),
            offset=state_int(state["offset"], "offset"),
            samples=state_int(state["samples"], "samples"),
            batch_size=None if batch_size is None else state_int(batch_size, "batch_size", 1),
            rank=rank,
            world=world,
            uneven=uneven,
            chain=_chain(state["chain"]),
            tail=_tail(state.get("tail")),
            base=None if state.get("base") is None else Base.from_json(state["base"], source_length),
            consumed=None
            if state.get("consumed") is None
            else tuple(indices(state["consumed"], "consumed", source_length)),
        )


def read_states(state: Any, source_length: int | None) -> list[SavedState]:
    """A state dict, or the list of every rank's, checked (see `SavedState.from_json`): what the
    Loader and Ray's trainers load alike."""
    raw = state if isinstance(state, list) else [state]
    if not raw or len(raw) > MAX_WORLD_SIZE:
        raise StateError(f"expected a state dict or the list of every rank's state dicts, got {state!r:.200}")
    return [SavedState.from_json(s, source_length) for s in raw]


_REQUIRED = ("fingerprint", "epoch", "task", "offset", "samples", "batch_size", "shard", "chain")


def _shard(value: Any) -> tuple[int, int, str]:
    if not isinstance(value, (list, tuple)) or len(value) != 3 or value[2] not in UNEVEN_POLICIES:
        raise StateError(
            f"state dict field 'shard' must be [rank, world_size, uneven] with uneven one of {UNEVEN_POLICIES}, "
            f"got {value!r:.100}"
        )
    world = state_int(value[1], "shard", 1, MAX_WORLD_SIZE, "world_size")
    return state_int(value[0], "shard", 0, world - 1, "rank"), world, value[2]


def _chain(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise StateError(f"state dict field 'chain' must map the chain's parts to digests, got {value!r:.100}")
    return value


def _tail(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("stages"), list)
        or not isinstance(value.get("queues"), list)
        or not all(isinstance(q, list) for q in value["queues"])
        or not isinstance(value.get("out"), list)
        or not isinstance(value.get("flushed"), bool)
        or isinstance(value.get("flushed_stages"), bool)
        or not isinstance(value.get("flushed_stages"), int)
    ):
        raise StateError(
            "state dict field 'tail' must be the tail's state (a dict of its 'stages', 'queues', 'out', "
            f"'flushed' and 'flushed_stages'), got {value!r:.100}"
        )
    return value


def indices(value: Any, field: str, bound: int | None = None) -> list[int]:
    """A list of sample indices in [0, bound), else a StateError naming `field`."""
    arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if arr is None or (arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu")):
        raise StateError(f"state dict field {field!r} must be a list of sample indices (ints), got {value!r:.100}")
    if arr.size and (arr.min() < 0 or (bound is not None and arr.max() >= bound)):
        raise StateError(f"state dict field {field!r} holds an index outside [0, {bound})")
    return [int(i) for i in arr]

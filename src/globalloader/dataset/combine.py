"""`Dataset.concat`, `Dataset.mix` and `Dataset.zip`: one random-access source made of datasets.

Each part is a chain of its own (source, index operators, per-sample maps, no batch). An epoch
position of the combination names a part and a position in that part's epoch; the part's own
operators turn it into one of its source indices, encoded as `offset[part] + index`, and its
maps make the record. `mix` interleaves parts in exact proportions with a smooth deterministic
schedule (part c's k-th record sits at time (k + 1/2) / weight_c); shuffle after mixing for a
random interleave. When a part runs out, `on_exhausted="stop"` ends the epoch (every epoch then
has exactly the proportions and no repeats), `"cycle"` restarts it with a fresh order of its own
until every part was read once.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader._seeding import derive
from globalloader.dataset.fingerprint import digest
from globalloader.errors import ArgumentError

if TYPE_CHECKING:
    from collections.abc import Callable

EXHAUSTED = ("stop", "cycle")
MAX_SCHEDULE = 1 << 28  # positions of one mix epoch (10 bytes each): beyond, weights are surely a mistake


def _normalized(weights: Sequence[float] | None, parts: int) -> tuple[float, ...]:
    """`weights` as proportions that sum to 1; each must be a finite number > 0."""
    bad = ArgumentError(f"mix: weights must be {parts} finite numbers > 0, got {weights!r}")
    if not isinstance(weights, (Sequence, np.ndarray)) or isinstance(weights, (str, bytes)):
        raise bad
    if np.ndim(weights) != 1 or len(weights) != parts:
        raise bad
    if any(isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) for x in weights):
        raise bad
    w = np.asarray(weights, dtype=np.float64)
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise bad
    w = w / w.max()  # huge weights would overflow their sum
    w = w / w.sum()
    if not (w > 0).all():
        raise ArgumentError(f"mix: weights {list(weights)} differ by more than a float can hold; check them")
    return tuple(w.tolist())


class Combined:
    """The source of a combined chain; `bind(seed)` makes the parts' plans under that root."""

    def __init__(
        self, kind: str, parts: Sequence[Any], weights: Sequence[float] | None = None, on_exhausted: str = "stop"
    ) -> None:
        parts = list(parts)  # gl.Dataset chains (checked by Dataset.concat/mix/zip)
        for k, part in enumerate(parts):
            plan = part.plan
            if not plan.combinable:
                raise ArgumentError(
                    f"{kind}: part {k} ({part!r}) must be a random-access chain of index operators and maps "
                    "(no stream, filter, flat_map, batch or pack); apply those after combining"
                )
        self.kind, self.parts, self.on_exhausted = kind, parts, on_exhausted
        if on_exhausted not in EXHAUSTED:
            raise ArgumentError(f"{kind}: on_exhausted must be one of {EXHAUSTED}, got {on_exhausted!r}")
        self.weights = _normalized(weights, len(parts)) if kind == "mix" else None
        self.plans: list[Any] = [p.plan for p in parts]
        self.seed: int | None = None

    def bind(self, seed: int, make_plan: Callable[..., Any]) -> Combined:
        """This combination under root `seed`: parts without their own `.seed()` derive theirs
        (`make_plan` is `IndexPlan`, whose module imports this one: parts are random access)."""
        bound = object.__new__(Combined)
        bound.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_schedule"})
        bound.seed = seed
        bound.plans = [
            make_plan(part.source, part._ops, inherited_seed=derive(seed, self.kind, k))
            for k, part in enumerate(self.parts)
        ]
        return bound

    # -- sizes ---------------------------------------------------------------------------------
    @cached_property
    def part_lengths(self) -> list[int]:
        lengths = [plan.samples for plan in self.plans]
        assert all(n is not None for n in lengths), "random-access parts know their lengths"
        return [int(n) for n in lengths]

    @cached_property
    def offsets(self) -> list[int]:
        """Where each part's source indices start in the combined index space (and where they end)."""
        return list(itertools.accumulate((plan.source_length for plan in self.plans), initial=0))

    def __len__(self) -> int:
        n = self.part_lengths
        if self.kind == "concat":
            return sum(n)
        if self.kind == "zip":
            return min(n)
        return len(self._schedule[0])

    @cached_property
    def index_space(self) -> int:
        """Combined source indices are below this (zip: positions; else the parts' offsets)."""
        return len(self) if self.kind == "zip" else self.offsets[-1]

    @cached_property
    def _schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """(part, ordinal in the part) at every position of a mix's epoch."""
        assert self.weights is not None
        n = self.part_lengths
        empty = [k for k, size in enumerate(n) if size == 0]
        if empty:
            part = self.parts[empty[0]]
            raise ArgumentError(f"mix: part {empty[0]} ({part!r}) has no samples; mix only non-empty parts")
        if self.on_exhausted == "stop":
            total = min(int(np.floor(n_c / w)) for n_c, w in zip(n, self.weights, strict=True))
        else:
            total = max(int(np.ceil(n_c / w)) for n_c, w in zip(n, self.weights, strict=True))
        if total > MAX_SCHEDULE:
            raise ArgumentError(
                f"mix: weights {self.weights} over parts of {n} samples make an epoch of {total:,} samples "
                f"(more than {MAX_SCHEDULE:,}); check the weights"
            )
        times = [(np.arange(int(np.ceil(total * w)) + 1) + 0.5) / w for w in self.weights]
        kind = np.int16 if len(times) < 2**15 else np.int32
        part = np.concatenate([np.full(len(t), c, dtype=kind) for c, t in enumerate(times)])
        order = np.argsort(np.concatenate(times), kind="stable")[:total]
        part = part[order]
        ordinal = np.empty(total, dtype=np.int64)
        end = total
        for c, size in enumerate(self.part_lengths):
            mask = part == c
            ordinal[mask] = np.arange(int(mask.sum()))
            if self.on_exhausted == "stop" and mask.sum() > size:  # rounding: end where part c runs out
                end = min(end, int(np.flatnonzero(mask)[size]))
        return part[:end], ordinal[:end]

    # -- positions to indices, indices to records -------------------------------------------------
    def resolve(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Combined source indices of epoch positions."""
        if self.kind == "zip":
            return positions
        if self.kind == "concat":
            starts = np.cumsum([0, *self.part_lengths])
            part = np.searchsorted(starts, positions, side="right") - 1
            ordinal = positions - starts[part]
        else:
            schedule_part, schedule_ordinal = self._schedule
            part, ordinal = schedule_part[positions], schedule_ordinal[positions]
        out = np.empty(len(positions), dtype=np.int64)
        for c, plan in enumerate(self.plans):
            mask = part == c
            if not mask.any():
                continue
            rounds, k = np.divmod(ordinal[mask], self.part_lengths[c])
            found = np.empty(len(k), dtype=np.int64)
            for r in np.unique(rounds).tolist():
                sel = rounds == r
                part_epoch = epoch if r == 0 else derive(epoch, "cycle", r) & 0x7FFFFFFF
                found[sel] = plan.map_positions(k[sel], part_epoch)
            out[mask] = self.offsets[c] + found
        return out

    def read(self, epoch: int, index: int, timer: dict[str, list[float]]) -> Any:
        if self.kind == "zip":
            return tuple(
                plan.sample(epoch, int(plan.map_positions(np.array([index]), epoch)[0]), timer) for plan in self.plans
            )
        c = bisect.bisect_right(self.offsets, index) - 1
        return self.plans[c].sample(epoch, index - self.offsets[c], timer)

    # -- identity ------------------------------------------------------------------------------
    @property
    def deterministic(self) -> bool:
        """A record depends on its index only (not the epoch): what sharing and disk caches need."""
        if any(m.random for plan in self.plans for m in plan.maps):
            return False
        if self.kind == "zip":  # a zip index is a position: the parts' epoch orders decide the record
            return not any(plan.epoch_dependent for plan in self.plans)
        return all(not isinstance(plan.source, Combined) or plan.source.deterministic for plan in self.plans)

    def identity(self, strict: bool) -> str:
        return digest(self.kind, self.weights, self.on_exhausted, self.seed, [p.identity(strict) for p in self.plans])

    def describe(self) -> str:
        return f"{self.kind}({', '.join(repr(p) for p in self.parts)})"

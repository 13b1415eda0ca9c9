"""`Dataset.map`: a per-sample (or per-batch) function, deterministic or random.

A function that accepts a keyword argument `rng` is random: it is called as `fn(x, rng=rng)` with
a NumPy Generator seeded from (seed, epoch, sample index, map position), so its output does not
depend on how many workers there are, which worker ran it, or whether the run was resumed.
A function without `rng` is deterministic: cacheable, and with `shared=True` shareable across jobs.

A map's identity (its part of the sharing, disk-cache and resume key) is the walk of `fn` in
`dataset.fingerprint`, or the explicit `key` the user gave: a promise that maps with equal keys
produce equal outputs, for functions whose state cannot be walked (or should not be).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from globalloader.dataset.fingerprint import digest, fingerprint


def takes_rng(fn: Callable[..., Any]) -> bool:
    """True when `fn` accepts an `rng` keyword (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == "rng" and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD for p in params)


def sample_rng(seed: int, epoch: int, index: int, position: int) -> np.random.Generator:
    """The Generator a random map gets for one sample: a pure function of its arguments."""
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, index, position])


@dataclass(frozen=True)
class MapOp:
    """One `map` in a chain; `position` numbers the maps so two random maps get distinct streams."""

    fn: Callable[..., Any]
    shared: bool
    name: str
    key: str | None = None
    random: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "random", takes_rng(self.fn))

    def identity(self, strict: bool = True) -> str:
        """The explicit key, else the walk of `fn`; strict raises FingerprintError when that walk
        cannot establish what decides the output, lenient counts such values by type only."""
        if self.key is not None:
            return digest("explicit key", self.key)
        fn = self.name if self.name.isidentifier() else "fn"
        shared = "shared=True, " if self.shared else ""
        fix = (
            f"Give the map an explicit key, a promise that equal keys mean equal outputs: "
            f'.map({fn}, {shared}key="{fn}-v1"), or give the callable a string `fingerprint` attribute'
        )
        return fingerprint(self.fn, f"map {self.name!r}", fix, strict)

    def apply(self, value: Any, seed: int, epoch: int, index: int, position: int) -> Any:
        if self.random:
            return self.fn(value, rng=sample_rng(seed, epoch, index, position))
        return self.fn(value)

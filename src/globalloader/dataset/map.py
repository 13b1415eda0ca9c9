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
from typing import TYPE_CHECKING, Any, ClassVar

from globalloader._seeding import generator
from globalloader.dataset.fingerprint import digest, fingerprint

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


def takes_rng(fn: Callable[..., Any]) -> bool:
    """True when `fn` accepts an `rng` keyword (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == "rng" and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD for p in params)


def describe_fn(
    method: str, fn: Callable[..., Any], name: str, key: str | None, strict: bool, shared: bool = False
) -> str:
    """The identity of a user function in a chain: its explicit key, else the walk of `fn`;
    strict raises FingerprintError when that walk cannot establish what decides the output,
    lenient counts such values by type only."""
    if key is not None:
        return digest("explicit key", key)
    arg = name if name.isidentifier() else "fn"
    flag = "shared=True, " if shared else ""
    fix = (
        f"Give the {method} an explicit key, a promise that equal keys mean equal outputs: "
        f'.{method}({arg}, {flag}key="{arg}-v1"), or give the callable a string `fingerprint` attribute'
    )
    return fingerprint(fn, f"{method} {name!r}", fix, strict)


@dataclass(frozen=True)
class MapOp:
    """One `map` in a chain (and the base of filter and flat_map); `apply`'s `position` numbers
    the maps so two random maps get distinct streams."""

    fn: Callable[..., Any]
    name: str
    key: str | None = None
    shared: bool = False
    random: bool = field(init=False)
    expands: bool = field(default=False, init=False)
    method: ClassVar[str] = "map"

    def __post_init__(self) -> None:
        object.__setattr__(self, "random", takes_rng(self.fn))

    def attach(self, plan: Builder) -> None:
        plan.add_record(self)

    def identity(self, strict: bool = True) -> str:
        return describe_fn(self.method, self.fn, self.name, self.key, strict, self.shared)

    def apply(self, value: Any, seed: int, epoch: int, index: int, position: int, *sub: int) -> Any:
        if self.random:
            return self.fn(value, rng=generator(seed, epoch, index, position, *sub))
        return self.fn(value)

    def describe(self) -> tuple[object, ...]:
        return (self.method, self.name)


@dataclass(frozen=True)
class ExpandingOp(MapOp):
    """What filter and flat_map share: a map whose sample may become no record or several (`expand`)."""

    expands: bool = field(default=True, init=False)

    def apply(self, value: Any, seed: int, epoch: int, index: int, position: int, *sub: int) -> list[Any]:
        out = self.fn(value, rng=generator(seed, epoch, index, position, *sub)) if self.random else self.fn(value)
        return self.expand(value, out)

    def expand(self, value: Any, out: Any) -> list[Any]:
        raise NotImplementedError

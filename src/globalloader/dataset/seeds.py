"""`Dataset.seed`: the one root of a chain's randomness, and the named streams derived from it.

Every random operator draws from its own stream, named by what it is and where it sits in the
chain: a shuffle without an explicit seed takes `derive(root, "shuffle", k)`, a random map at
position k gets a Generator per sample from (root, epoch, index, k). Changing one operator's
stream therefore never changes another's, and a chain without any shuffle still gives every
sample its own generator. Datasets combined by concat/mix/zip get roots derived from the
combination's root unless they set their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from globalloader.errors import check_int

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True)
class SeedOp:
    """`.seed(s)`: sets the root for the whole chain (wherever it is written)."""

    seed: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", check_int(self.seed, "seed: seed"))

    def attach(self, plan: Builder) -> None:
        """Nothing to join: the plan reads the root seed before any operator attaches."""

    def describe(self) -> tuple[object, ...]:
        return ("seed", self.seed)

"""(seed, epoch, stream) -> NumPy Generator: the one derivation of every random order.

Every random draw of the library comes from a `SeedSequence` of (seed, epoch, words), where the
words name the stream and, for per-item streams, the item. A stream's name is a fixed word so
two operators never share draws; the words below are the ones each order was first pinned with,
so a seed keeps giving the same order across releases. Seeds are taken modulo 2**64 (callers
that must not wrap refuse larger seeds with `check_seed`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from globalloader.errors import ArgumentError, check_int

MASK = 0xFFFFFFFFFFFFFFFF

# Named streams: the word that tells each stream from its siblings.
PERMUTATION = 0x5EED  # sampling.Permutation: the Feistel keys, or the explicit order of a small set
BUFFER_SHUFFLE = 0xB0F  # dataset.shuffle: the shuffle buffer's swaps
WINDOW_BLOCKS = 0xB10C  # dataset.shuffle: the windowed order of the blocks
WINDOW_ROWS = 0x5105  # dataset.shuffle: each window's row order, after the window's number
RAY_TABLE, RAY_MAP, RAY_REDUCE = 0, 1, 2  # ray: the scatter table, then per map task, per reducer


def check_seed(seed: Any, what: str) -> int:
    """A seed that keys a 64-bit order, as an int: a larger one would share its order with the
    seed it equals modulo 2**64, so it is refused rather than cut (an ArgumentError naming `what`)."""
    value = check_int(seed, what)
    if value > MASK:
        raise ArgumentError(f"{what} must be below 2**64, got {value}")
    return value


def sequence(seed: int, *words: int) -> np.random.SeedSequence:
    """The seed sequence of stream `words` (the epoch, then the stream's name and item) under
    `seed`: a pure function of its arguments."""
    return np.random.SeedSequence([int(seed) & MASK, *(int(word) for word in words)])


def generator(seed: int, *words: int) -> np.random.Generator:
    """The Generator of stream `words` under `seed` (PCG64 over `sequence`)."""
    return np.random.Generator(np.random.PCG64(sequence(seed, *words)))


def spawned_generator(seed: int, epoch: int) -> np.random.Generator:
    """The Generator of `epoch` spawned from `seed` alone: the joint sampler's plain job order,
    pinned with the epoch as the spawn key (its words differ from `generator(seed, epoch)`)."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(epoch,)))


def entropy_seed() -> int:
    """A fresh 63-bit seed from the operating system, for a stream that is never replayed."""
    entropy = np.random.SeedSequence().entropy
    assert isinstance(entropy, int)  # drawn from the OS: an int when none is given
    return entropy & (2**63 - 1)


def derive(root: int, *names: object) -> int:
    """A 63-bit seed for the stream `names` under `root` (stable across runs and machines)."""
    text = repr((int(root), *names)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

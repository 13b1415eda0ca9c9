"""from_sequence: any in-memory Python sequence as a source (items as they are), for tests and small data."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from globalloader.errors import ArgumentError, FingerprintError
from globalloader.sources.base import check_index


class SequenceSource:
    """The items of a Python sequence as records, as they are: `src[i] is seq[i]`.

    The rule is the same as `Dataset(seq)` on the bare sequence: nothing is wrapped, so a list of
    ints yields ints and a list of dicts yields those dicts (give them a `"__key__"` to have
    errors name it; otherwise errors name the index). What `from_sequence` adds is the
    `fingerprint` that `cache(path)` and `share=True` need to recognise the data.

    Items are returned without copying, so a map that mutates a dict record mutates the
    sequence. `fingerprint` is a SHA-256 of the pickled sequence, computed on first use and kept
    (so later mutation of the sequence is not seen), or the `key` given; items that cannot be
    pickled and no key is a FingerprintError when a fingerprint is needed (share=True,
    cache(path)), never a guess.
    """

    def __init__(self, seq: Sequence[Any], key: str | None = None) -> None:
        # Duck-typed, so NumPy arrays and custom containers pass; text and mappings are
        # refused because indexing them by position is almost always a mistake.
        if isinstance(seq, (str, bytes, dict)) or not (hasattr(seq, "__len__") and hasattr(seq, "__getitem__")):
            raise ArgumentError(f"seq must be a sequence (list, tuple, array...), got {type(seq).__name__}")
        self.seq = seq
        self._len = len(seq)
        if key is not None and (not isinstance(key, str) or not key):
            raise ArgumentError(f"from_sequence: key must be a non-empty str, got {key!r}")
        self._fingerprint: str | None = None if key is None else f"sequence-key:{key}"

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        return self.seq[index]

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            try:
                blob = pickle.dumps(self.seq, protocol=5)
            except Exception as exc:  # noqa: BLE001 - any unpicklable item
                raise FingerprintError(
                    f"from_sequence: the items cannot be pickled ({type(exc).__name__}: {exc}), so their content "
                    "cannot be fingerprinted; give the data a name: from_sequence(seq, key='my-data-v1')"
                ) from None
            else:
                self._fingerprint = f"sequence:{hashlib.sha256(blob).hexdigest()[:32]}"
        return self._fingerprint

    def __repr__(self) -> str:
        return f"from_sequence({type(self.seq).__name__} of {self._len})"


def from_sequence(seq: Sequence[Any], key: str | None = None) -> SequenceSource:
    """`seq` (list, tuple, NumPy array, any object with len and [i]) as a source whose records are
    its items, unchanged: `Dataset(from_sequence(seq))` yields what `Dataset(seq)` yields, plus a
    content fingerprint (or `key`, the caller's promise that equal keys mean equal items)."""
    return SequenceSource(seq, key)

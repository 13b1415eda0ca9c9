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

    As for `Dataset(seq)`, nothing is wrapped or copied (a map that mutates a dict record mutates
    the sequence); what `from_sequence` adds is the `fingerprint` that `cache(path)` and
    `share=True` need: a SHA-256 of the pickled sequence, computed once on first use, or the `key`
    given. Items that cannot be pickled, and no key, are a FingerprintError then, never a guess.
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
            self._fingerprint = f"sequence:{hashlib.sha256(blob).hexdigest()[:32]}"
        return self._fingerprint

    def __repr__(self) -> str:
        return f"from_sequence({type(self.seq).__name__} of {self._len})"


def from_sequence(seq: Sequence[Any], key: str | None = None) -> SequenceSource:
    """`seq` (list, tuple, NumPy array, any object with len and [i]) as a source whose records are
    its items, unchanged: `Dataset(from_sequence(seq))` yields what `Dataset(seq)` yields, plus a
    content fingerprint (or `key`, the caller's promise that equal keys mean equal items)."""
    return SequenceSource(seq, key)

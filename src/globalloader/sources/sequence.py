"""from_sequence: any in-memory Python sequence as a source (items as they are), for tests and small data.

A list of a million Python objects costs forked workers as much private memory as it holds:
reading an item writes its reference count, and the page around it is copied into the worker
(PyTorch issue 13246). So a list or tuple of one plain kind (str, bytes, int, float or bool) is
kept as flat NumPy buffers instead, which reading leaves untouched: the workers share them with
the parent, whatever their number. Items come back equal and of the same type; anything else
(mixed kinds, subclasses, ints beyond 64 bits, dicts...) is kept as given.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from globalloader.errors import ArgumentError, FingerprintError
from globalloader.sources.base import check_index

_NUMBERS = {int: np.int64, float: np.float64, bool: np.bool_}  # exact item type -> array dtype


class _FlatText:
    """str or bytes items as one byte buffer and the offsets of its items: two objects in all.

    str is stored as UTF-8 with `surrogatepass`, so every Python str (lone surrogates from
    `os.fsdecode` of a non-UTF-8 file name included) comes back as it was."""

    def __init__(self, items: Sequence[Any], text: bool) -> None:
        self.text = text
        encoded = items
        if not text:
            data = b"".join(items)
        elif (joined := "".join(items)).isascii():  # one encode, and character counts are byte counts
            data = joined.encode("ascii")
        else:
            encoded = [s.encode("utf-8", "surrogatepass") for s in items]
            data = b"".join(encoded)
        self.offsets = np.zeros(len(items) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(items)), out=self.offsets[1:])
        self.data = data

    def __getitem__(self, index: int) -> str | bytes:
        raw = self.data[self.offsets.item(index) : self.offsets.item(index + 1)]  # .item: no array made
        return raw.decode("utf-8", "surrogatepass") if self.text else raw

    def digest_parts(self) -> tuple[bytes, ...]:
        return (b"str" if self.text else b"bytes", self.offsets.tobytes(), self.data)


class _FlatNumbers:
    """int, float or bool items as one NumPy array; `.item` gives back the Python number."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __getitem__(self, index: int) -> int | float | bool:
        return self.values.item(index)

    def digest_parts(self) -> tuple[bytes, ...]:
        return (self.values.dtype.str.encode(), self.values.tobytes())


def _flat(seq: Sequence[Any]) -> _FlatText | _FlatNumbers | None:
    """`seq` in flat buffers, or None where it is not a list or tuple of one plain kind."""
    if not isinstance(seq, (list, tuple)) or not seq:
        return None
    kinds = set(map(type, seq))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is str or kind is bytes:
        return _FlatText(seq, text=kind is str)
    if kind in _NUMBERS:
        try:
            return _FlatNumbers(np.array(seq, dtype=_NUMBERS[kind]))
        except OverflowError:  # an int beyond 64 bits: kept as given
            return None
    return None


class SequenceSource:
    """The items of a Python sequence as records, as they are: `src[i] == seq[i]`, same type.

    As for `Dataset(seq)`, nothing else is wrapped or copied (a map that mutates a dict record
    mutates the sequence); lists of plain values are kept flat (see the module's docstring). What
    `from_sequence` adds is the `fingerprint` that `cache(path)` and `share=True` need: a SHA-256
    of the items (of the flat buffers, or of the pickled sequence), computed once on first use,
    or the `key` given. Items that cannot be pickled, and no key, are a FingerprintError then,
    never a guess.
    """

    def __init__(self, seq: Sequence[Any], key: str | None = None) -> None:
        # Duck-typed, so NumPy arrays and custom containers pass; text and mappings are
        # refused because indexing them by position is almost always a mistake.
        if isinstance(seq, (str, bytes, dict)) or not (hasattr(seq, "__len__") and hasattr(seq, "__getitem__")):
            raise ArgumentError(f"seq must be a sequence (list, tuple, array...), got {type(seq).__name__}")
        if key is not None and (not isinstance(key, str) or not key):
            raise ArgumentError(f"from_sequence: key must be a non-empty str, got {key!r}")
        self._len = len(seq)
        self._kind = type(seq).__name__
        self._flat = _flat(seq)
        # The items, read by index: the flat buffers, or the sequence itself (never both: the
        # workers must not reach a list of objects they would copy page by page).
        self._items: Any = seq if self._flat is None else self._flat
        self._fingerprint: str | None = None if key is None else f"sequence-key:{key}"

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        return self._items[index]

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            if self._flat is not None:
                sha = hashlib.sha256(b"flat")
                for part in self._flat.digest_parts():
                    sha.update(len(part).to_bytes(8, "little"))
                    sha.update(part)
            else:
                try:
                    sha = hashlib.sha256(pickle.dumps(self._items, protocol=5))
                except Exception as exc:  # noqa: BLE001 - any unpicklable item
                    raise FingerprintError(
                        f"from_sequence: the items cannot be pickled ({type(exc).__name__}: {exc}), so their content "
                        "cannot be fingerprinted; give the data a name: from_sequence(seq, key='my-data-v1')"
                    ) from None
            self._fingerprint = f"sequence:{sha.hexdigest()[:32]}"
        return self._fingerprint

    def __repr__(self) -> str:
        return f"from_sequence({self._kind} of {self._len})"


def from_sequence(seq: Sequence[Any], key: str | None = None) -> SequenceSource:
    """`seq` (list, tuple, NumPy array, any object with len and [i]) as a source whose records are
    its items, unchanged: `Dataset(from_sequence(seq))` yields what `Dataset(seq)` yields, plus a
    content fingerprint (or `key`, the caller's promise that equal keys mean equal items)."""
    return SequenceSource(seq, key)

"""`Dataset.pack`: concatenate token sequences into fixed-length rows for language models.

Documents are laid end to end; one that does not fit continues at the start of the next row,
so no token is dropped and no space is wasted except at the end of the epoch. Each row comes
with `segment_ids` (1, 2, ... per document piece in the row, 0 for padding) and `positions`
(restarting at 0 for each piece), so attention can be masked between documents.

Token values are never changed: a row's dtype is `dtype=` when given (a document holding a token
it cannot store is a `TransformError`), else the common type of the documents in the row by
NumPy's promotion rules (int8 then int64 documents make an int64 row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader.dataset.collate import common_dtype, fits
from globalloader.errors import ArgumentError, TransformError, check_int

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True)
class PackOp:
    """Rows of `seq_len` tokens from records holding 1-D integer arrays at `key` (or bare arrays)."""

    seq_len: int
    key: str | None = "tokens"
    pad: int = 0
    drop_last: bool = False
    dtype: np.dtype[Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_len", check_int(self.seq_len, "pack: seq_len", 1))
        if self.seq_len > np.iinfo(np.int32).max:
            raise ArgumentError(f"pack: seq_len must fit the int32 positions, got {self.seq_len}")
        if self.key is not None and not isinstance(self.key, str):
            raise ArgumentError(f"pack: key must be a str or None (bare arrays), got {self.key!r}")
        if isinstance(self.pad, bool) or not isinstance(self.pad, (int, np.integer)):
            raise ArgumentError(f"pack: pad must be an int token id, got {self.pad!r}")
        if self.dtype is not None:
            if not isinstance(self.dtype, np.dtype) or self.dtype.kind not in "iu":
                raise ArgumentError(f"pack: dtype must be an integer NumPy dtype, got {self.dtype!r}")
            if not fits(self.pad, self.dtype):
                raise ArgumentError(f"pack: pad={self.pad} does not fit dtype {self.dtype}")

    def attach(self, plan: Builder) -> None:
        plan.add_tail(self, "pack")

    def identity(self, strict: bool) -> tuple[object, ...]:
        return self.describe()

    def describe(self) -> tuple[object, ...]:
        fixed = () if self.dtype is None else (self.dtype.str,)
        return ("pack", self.seq_len, self.key, int(self.pad), self.drop_last, *fixed)

    def stage(self, seed: int, epoch: int, position: int) -> PackStage:
        return PackStage(self)


class PackStage:
    def __init__(self, op: PackOp) -> None:
        self.op = op
        self.pieces: list[np.ndarray] = []  # of the row being filled
        self.filled = 0

    def _tokens(self, item: Any) -> np.ndarray:
        key = self.op.key
        value = item.get(key) if key is not None and isinstance(item, dict) else item if key is None else None
        if value is None:
            got = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise TransformError(f"pack: a record has no token array at key {key!r} (got {got})")
        tokens = np.asarray(value)
        if tokens.shape == (0,):
            return tokens  # an empty document ([] is float64 to NumPy): no token to keep or change
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TransformError(
                f"pack: {key or 'the record'} must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
            )
        dtype = self.op.dtype
        if dtype is not None and tokens.dtype != dtype and len(tokens):
            low, high = tokens.min(), tokens.max()
            if not (fits(low.item(), dtype) and fits(high.item(), dtype)):
                raise TransformError(
                    f"pack: {key or 'the record'} holds tokens {low}..{high} that dtype {dtype} cannot hold"
                )
            tokens = tokens.astype(dtype)
        return tokens

    def feed(self, item: Any) -> list[Any]:
        tokens, rows = self._tokens(item), []
        while len(tokens):
            take = min(len(tokens), self.op.seq_len - self.filled)
            self.pieces.append(tokens[:take])
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.op.seq_len:
                rows.append(self._row())
        return rows

    def flush(self) -> list[Any]:
        return [self._row()] if self.pieces and not self.op.drop_last else []

    def _row(self) -> dict[str, np.ndarray]:
        n, name = self.op.seq_len, self.op.key or "tokens"
        dtype = common_dtype([p.dtype for p in self.pieces], f"pack[{name!r}]")
        if not fits(self.op.pad, dtype):
            raise ArgumentError(
                f"pack: pad={self.op.pad} does not fit the {name!r} dtype {dtype}; pass pack(dtype=...) that holds both"
            )
        tokens = np.full(n, self.op.pad, dtype=dtype)
        segments = np.zeros(n, dtype=np.int32)
        positions = np.zeros(n, dtype=np.int32)
        at = 0
        for s, piece in enumerate(self.pieces, start=1):
            end = at + len(piece)
            tokens[at:end], segments[at:end], positions[at:end] = piece, s, np.arange(len(piece))
            at = end
        self.pieces, self.filled = [], 0
        return {name: tokens, "segment_ids": segments, "positions": positions}

    def state(self) -> Any:
        return [p.copy() for p in self.pieces]

    def restore(self, state: Any) -> None:
        pieces = [np.asarray(p) for p in state]
        if any(p.ndim != 1 or p.dtype.kind not in "iu" for p in pieces) or sum(map(len, pieces)) >= self.op.seq_len:
            raise ValueError(f"a partial row must be 1-D integer pieces of fewer than {self.op.seq_len} tokens")
        self.pieces, self.filled = pieces, sum(len(p) for p in pieces)

    def held(self) -> list[Any]:
        """The partial row's pieces, as documents (a piece is packed alone, as it was)."""
        key = self.op.key
        return [p.copy() if key is None else {key: p.copy()} for p in self.pieces]

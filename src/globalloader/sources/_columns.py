"""Batches gathered column by column from a source made of blocks (`Parquet`, its Arrow copy).

A batch built from records costs a dict per row and a Python value per cell, then a collate that
walks them again: most of a fast read's time. When a chain batches a source's rows with the
default collate and nothing in between, the plan asks the source for the batch itself
(`read_columns`): a few NumPy and Arrow takes per column. The result is exactly what collating
the records gives (the same keys, values and dtypes: numbers as int64, float64 or bool, text and
bytes as lists), so a chain's output does not depend on which path built it. Only columns whose
batch dtype does not depend on the data are gathered (see `gatherable`); a source with any other
column is read by record. `BlockGather` serves `Parquet`; the Arrow copy gathers by file offset
(`sources._mapped_columns`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.errors import ArgumentError
from globalloader.sources._arrow_values import as_float64, is_bytes, is_text, to_numpy

Rows = slice | np.ndarray  # rows of one block: a run, or positions
_SLICES = 64  # rows read in order in fewer runs than this are read as slices


def gatherable(kind: Any, as_float: bool) -> bool:
    """Whether a column of Arrow type `kind` has a batch dtype fixed by its type: numbers (not
    uint64, whose Python values collate to int64 or uint64 by size), booleans, text, bytes."""
    pa = _extras.require("pyarrow", "parquet")
    if as_float or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return True
    if pa.types.is_integer(kind):
        return not pa.types.is_uint64(kind)
    return is_text(kind) or is_bytes(kind)


def batch_dtype(kind: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype a collate gives to the Python values of a number column of NumPy dtype `kind`."""
    return np.dtype(bool) if kind.kind == "b" else np.dtype(np.float64 if kind.kind == "f" else np.int64)


def batch_values(column: Any, name: str, as_float: bool) -> Any:
    """One gatherable Arrow column of a block, ready to gather from: numbers as a NumPy array of
    their own dtype (float nulls NaN; `as_float`: float64 with NaN for nulls), widened to their
    batch dtype only in the rows a batch takes; text and bytes stay an Arrow array, made Python
    values only for the rows a batch takes (rows read out of order would otherwise touch Python
    objects scattered over the whole block)."""
    pa = _extras.require("pyarrow", "parquet")
    kind = column.type
    if as_float:
        return as_float64(column, name)
    if pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return to_numpy(column)
    return column


def _numbers(values: np.ndarray, at: Rows) -> np.ndarray:
    """Numbers at `at` in their batch dtype, always a new array (a slice is a view of the block)."""
    return values[at].astype(batch_dtype(values.dtype), copy=isinstance(at, slice))


def _arrow_rows(values: Any, rows: Rows) -> Any:
    return values.slice(rows.start, rows.stop - rows.start) if isinstance(rows, slice) else values.take(rows)


def split_batch(batch: dict[str, Any], parts: list[np.ndarray]) -> list[dict[str, Any]]:
    """The batches of the leading `parts` whose rows `batch` holds, in order (numbers as views of
    `batch`'s arrays: each batch its own rows)."""
    cuts = np.cumsum([len(part) for part in parts]).tolist()
    held = len(batch["__key__"])
    return [{name: values[a:b] for name, values in batch.items()} for a, b in pairwise([0, *cuts]) if b <= held]


class BlockIndex:
    """Finds the block of each of a batch's rows. A binary search per row, with the rows out of
    order, costs several times more than the rest of a shuffled batch's lookups: instead a table
    over even steps of the rows gives each row a first guess, which a few vectorized steps
    correct (one when blocks are about even in size)."""

    def __init__(self, starts: np.ndarray, length: int) -> None:
        self._starts = np.append(starts, length).astype(np.int64)  # every block's first row, and the end
        self._step = max(1, length // max(1, 4 * len(starts)))
        self._table = np.searchsorted(starts, np.arange(0, max(length, 1), self._step), side="right") - 1

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        blocks = self._table[indices // self._step]
        while True:
            later = self._starts[blocks + 1] <= indices  # the row lies in a later block
            if not later.any():
                return blocks
            blocks += later


Origins = tuple[np.ndarray, np.ndarray, list[str]]  # each block's file and first row in it; files' key prefixes


def check_columnar(source: Any) -> None:
    if not source.columnar:
        raise ArgumentError(
            f"{source!r} has columns whose batch dtype depends on the data (lists, structs, uint64, "
            "dictionaries, times, decimals); read its records instead of read_columns"
        )


def keys_of(origins: Origins, starts: np.ndarray, blocks: np.ndarray, indices: np.ndarray) -> list[str]:
    """The records' keys, `"<file>:<row in file>"`, of the rows at global `indices`, in `blocks`
    (`starts`: each block's first global row)."""
    files, first_rows, prefixes = origins
    if len(prefixes) == 1:  # one file: a row's global index is its row in the file
        return [prefixes[0] + number for number in map(str, indices.tolist())]
    numbers = map(str, (first_rows[blocks] + indices - starts[blocks]).tolist())
    return [prefixes[f] + number for f, number in zip(files[blocks].tolist(), numbers, strict=True)]


class BlockGather:
    """Gathers batches from a source's decoded blocks (`Parquet`'s row groups): for sources whose
    tasks touch few blocks each.

    A task in order reads runs of one or two blocks: slices. A task of a windowed shuffle takes
    its rows from the same few blocks as the task before it (or gathers several tasks at once:
    `reused`): those blocks are merged once into one array per column, and each such task is
    then one take per column, in the task's order.
    Other tasks read block by block, in row order, and are put in the task's order after.

    `starts`: each block's first global row; `length`: the source's rows; `origins`: see
    `Origins`; `block(b)`: block b's columns as `batch_values` makes them (the source caches
    them)."""

    def __init__(
        self,
        names: Sequence[str],
        starts: np.ndarray,
        length: int,
        origins: Origins,
        block: Callable[[int], list[Any]],
    ) -> None:
        self._pa = _extras.require("pyarrow", "parquet")
        self._names = list(names)
        self._starts = starts
        self._locate = BlockIndex(starts, length)
        self._origins = origins
        self._block = block
        self._last: tuple[int, ...] = ()  # the blocks of the last task
        self._merged: tuple[np.ndarray, list[Any]] | None = None  # see _merge

    def __call__(self, indices: np.ndarray, reused: bool = False, blocks: np.ndarray | None = None) -> dict[str, Any]:
        """The batch of the rows at `indices` (global, in range, at least one), in that order.
        `reused`: the caller knows later tasks read the same blocks (merge them now); `blocks`:
        each row's block, when the caller has located them already."""
        blocks = self._locate(indices) if blocks is None else blocks
        batch: dict[str, Any] = {"__key__": keys_of(self._origins, self._starts, blocks, indices)}
        if not self._names:
            return batch
        rows = indices - self._starts[blocks]
        if bool(np.all(indices[1:] > indices[:-1])):
            columns = self._in_order(blocks, rows)
        else:
            merged = self._merged
            places = merged[0][blocks] if merged is not None else None
            if places is None or not bool((places >= 0).all()):
                distinct = tuple(np.unique(blocks).tolist())
                if reused or distinct == self._last:  # the second task in a row on these blocks: merge them
                    merged = self._merge(distinct)
                    places = merged[0][blocks]
                self._last = distinct
            if merged is not None and places is not None and bool((places >= 0).all()):
                columns = [self._take(values, places + rows) for values in merged[1]]
            else:
                columns = self._by_block(blocks, rows)
        batch.update(zip(self._names, columns, strict=True))
        return batch

    def ahead(self, parts: list[np.ndarray]) -> list[dict[str, Any]]:
        """The batch of each part (rows already checked), in one gather, for the leading parts whose
        rows lie in the blocks of the first part (at least the first): a source's
        `read_columns_ahead`, no more blocks than its current task holds."""
        rows = np.concatenate(parts)
        sharing, blocks = self.sharing_blocks(rows, [len(part) for part in parts])
        held = sum(len(part) for part in parts[:sharing])
        return split_batch(self(rows[:held], reused=sharing > 1, blocks=blocks[:held]), parts)

    def sharing_blocks(self, rows: np.ndarray, sizes: list[int]) -> tuple[int, np.ndarray]:
        """How many leading parts of `rows` (global rows, parts of `sizes` rows, at least one
        each) have all their rows in blocks of the first part; and each row's block."""
        blocks = self._locate(rows)
        held = np.zeros(len(self._starts), dtype=bool)
        held[blocks[: sizes[0]]] = True
        starts = np.cumsum([0, *sizes[:-1]])
        whole = np.logical_and.reduceat(held[blocks], starts)  # each part: all its rows held
        return (int(np.argmin(whole)) if not whole.all() else len(sizes)), blocks

    def _in_order(self, blocks: np.ndarray, rows: np.ndarray) -> list[Any]:
        """Rows in increasing order: a slice of each run of consecutive rows of a block (a few
        tasks of one worker gathered at once are a few runs), or positions in each block when
        the runs are many and short."""
        changes = blocks[1:] != blocks[:-1]
        runs = np.flatnonzero(changes | (rows[1:] != rows[:-1] + 1)) + 1
        cuts = [0, *(runs if len(runs) < _SLICES else np.flatnonzero(changes) + 1).tolist(), len(blocks)]
        pieces: list[list[Any]] = [[] for _ in self._names]
        for lo, hi in pairwise(cuts):
            first, last = int(rows[lo]), int(rows[hi - 1])
            run: Rows = slice(first, last + 1) if last - first == hi - lo - 1 else rows[lo:hi]  # gaps: positions
            for piece, values in zip(pieces, self._block(int(blocks[lo])), strict=True):
                piece.append(_numbers(values, run) if isinstance(values, np.ndarray) else _arrow_rows(values, run))
        return [self._joined(piece, None) for piece in pieces]

    def _by_block(self, blocks: np.ndarray, rows: np.ndarray) -> list[Any]:
        """Any rows: read block by block in row order, then put in the task's order."""
        order = np.lexsort((rows, blocks))
        blocks, rows = blocks[order], rows[order]
        inverse = np.empty(len(order), dtype=np.intp)
        inverse[order] = np.arange(len(order))
        cuts = [0, *(np.flatnonzero(blocks[1:] != blocks[:-1]) + 1).tolist(), len(blocks)]
        pieces: list[list[Any]] = [[] for _ in self._names]
        for lo, hi in pairwise(cuts):
            for piece, values in zip(pieces, self._block(int(blocks[lo])), strict=True):
                at = rows[lo:hi]
                piece.append(_numbers(values, at) if isinstance(values, np.ndarray) else values.take(at))
        return [self._joined(piece, inverse) for piece in pieces]

    def _merge(self, distinct: tuple[int, ...]) -> tuple[np.ndarray, list[Any]]:
        """Join the columns of blocks `distinct`; and where each block's first row lands (-1:
        a block not joined), per block of the source."""
        columns = [self._block(b) for b in distinct]
        sizes = [len(block[0]) for block in columns]
        places = np.full(len(self._starts), -1, dtype=np.int64)
        places[list(distinct)] = np.concatenate([[0], np.cumsum(sizes[:-1])])
        joined = [  # one block needs no copy: takes from it make new arrays anyway
            parts[0]
            if len(parts) == 1
            else np.concatenate(parts, dtype=batch_dtype(parts[0].dtype))  # widened once, not per take
            if isinstance(parts[0], np.ndarray)
            else self._pa.concat_arrays(parts)
            for parts in zip(*columns, strict=True)
        ]
        self._merged = (places, joined)
        return self._merged

    def _take(self, values: Any, places: np.ndarray) -> Any:
        return _numbers(values, places) if isinstance(values, np.ndarray) else values.take(places).to_pylist()

    def _joined(self, piece: list[Any], inverse: np.ndarray | None) -> Any:
        if isinstance(piece[0], np.ndarray):
            numbers = np.concatenate(piece) if len(piece) > 1 else piece[0]
            return numbers if inverse is None else numbers[inverse]
        values = self._pa.concat_arrays(piece) if len(piece) > 1 else piece[0]
        return (values if inverse is None else values.take(inverse)).to_pylist()

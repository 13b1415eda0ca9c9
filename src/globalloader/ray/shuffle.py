"""One epoch's map/reduce on Ray core: map tasks scatter parts, reducers permute and cut.

`submit_map` and `submit_reduce` start the tasks (the scheduler decides when); each task also
returns a tiny value that tells the scheduler it has ended without fetching any data. A map
task reads one part (`reader`) whole and runs the chain's maps on it (or takes the rows that a
stage-1 task, `submit_run`, made of it: a chain that drops or makes rows), and sends each
reducer the rows `layout.scatter_table` gave it, picked by a seeded permutation; the rows for
the reducers of one node travel in one object that each slices (an object per reducer costs Ray
a few milliseconds each, more than copying its rows). A reducer places the rows it receives at
seeded random positions and returns one dict of columns holding a run of its trainer's batches,
which trainers slice without copying. Rows are gathered and placed as single fixed-size
records: one copy per row whatever its width, no per-row Python.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from globalloader._seeding import RAY_MAP, RAY_REDUCE, generator
from globalloader.errors import SourceError
from globalloader.ray.reader import Part, read_part


def submit_run(part: Part, columns: Sequence[str] | None, epoch: int) -> tuple[ray.ObjectRef, ray.ObjectRef]:
    """Start one stage-1 task: (the rows `part` makes in `epoch`, their count)."""
    # With num_returns > 1 Ray returns a list of refs; its type hints know a single ref only.
    rows, count = cast("list[ray.ObjectRef[Any]]", _run_part.options(num_returns=2).remote(part, columns, epoch))
    return rows, count


def submit_map(
    part: Part | ray.ObjectRef,
    file_index: int,
    columns: Sequence[str] | None,
    group_rows: np.ndarray,
    file_rows: int,
    seed: int,
    epoch: int,
) -> tuple[list[ray.ObjectRef], ray.ObjectRef]:
    """Start one map task: (one object per reducer group, a small ref that resolves when it
    ends). `group_rows[g]` rows go to group g, whose reducers slice their own rows out of it.
    `part`: the part to read, or the ref of its rows from `submit_run` (Ray runs the task where
    they are)."""
    # With num_returns > 1 Ray returns a list of refs; its type hints know a single ref only.
    refs = cast(
        "list[ray.ObjectRef[Any]]",
        _map_file.options(num_returns=len(group_rows) + 1).remote(
            part, file_index, columns, group_rows, file_rows, seed, epoch
        ),
    )
    return list(refs[:-1]), refs[-1]


def submit_reduce(
    reducer_index: int,
    seed: int,
    epoch: int,
    urls: list[str],
    slices: list[tuple[int, int]],
    groups: list[ray.ObjectRef],
    node: str | None,
) -> tuple[ray.ObjectRef, ray.ObjectRef]:
    """Start one reducer: (its output ref, a small ref that resolves when it ends).

    It reads rows `slices[i]` = (start, count) of map output `groups[i]`. `node`: the node of
    the trainer it feeds; the reducer prefers to run there (soft affinity) so the map outputs
    its node needs travel once and the trainer maps its batches from local shared memory.
    """
    options: dict[str, Any] = {"num_returns": 2}
    if node:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
    output, done = _reduce.options(**options).remote(reducer_index, seed, epoch, urls, slices, *groups)
    return output, done


@ray.remote(num_cpus=1)
def _run_part(part: Part, columns: Sequence[str] | None, epoch: int) -> tuple[dict[str, np.ndarray], int]:
    """Stage 1: the rows `part` makes through the chain in `epoch`, and how many."""
    data = read_part(part, columns, epoch)
    return data, len(next(iter(data.values()))) if data else 0


@ray.remote(num_cpus=1)
def _map_file(
    part: Part | dict[str, np.ndarray],
    file_index: int,
    columns: Sequence[str] | None,
    group_rows: np.ndarray,
    expected_rows: int,
    seed: int,
    epoch: int,
) -> Any:
    """Read one part (or take its stage-1 rows) and split a seeded permutation of its rows into
    `group_rows` per group."""
    data = read_part(part, columns, epoch) if isinstance(part, Part) else part
    rows = len(next(iter(data.values()))) if data else 0
    if isinstance(part, Part) and rows != expected_rows:
        raise SourceError(
            f"{part.name} holds {rows} rows but held {expected_rows} when the shuffle "
            "was planned: the file changed; start the shuffle again"
        )
    keep = generator(seed, epoch, RAY_MAP, file_index).permutation(rows)[: int(group_rows.sum())]
    taken = {name: _take_rows(column, keep) for name, column in data.items()}
    bounds = np.concatenate([[0], np.cumsum(group_rows)]).tolist()
    groups = [{name: column[a:b] for name, column in taken.items()} for a, b in itertools.pairwise(bounds)]
    return (*groups, rows)  # the last, tiny value tells the scheduler the task has ended


@ray.remote(num_cpus=1)
def _reduce(
    reducer_index: int,
    seed: int,
    epoch: int,
    urls: list[str],
    slices: list[tuple[int, int]],
    *groups: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], int]:
    """Place the received rows at seeded random positions: one reducer's run of batches."""
    parts = [
        {name: column[a : a + n] for name, column in group.items()}
        for (a, n), group in zip(slices, groups, strict=True)
    ]
    total = sum(n for _, n in slices)
    slots = generator(seed, epoch, RAY_REDUCE, reducer_index).permutation(total)
    first_part = parts[0]
    names = list(first_part)
    out: dict[str, np.ndarray] = {}
    for url, part in zip(urls, parts, strict=True):
        if part.keys() != first_part.keys():
            raise SourceError(
                f"{url} has columns {list(part)} but {urls[0]} has {names}: "
                "all files of a shuffle need the same columns"
            )
    for name in names:
        first = parts[0][name]
        # Numbers take the type every part fits, whichever came first (a part whose integers hold
        # a null is float64); any other type must match the first part's.
        dtypes = [part[name].dtype for part in parts]
        dtype = np.result_type(*dtypes) if all(d.kind in "biuf" for d in dtypes) else first.dtype
        column = np.empty((total, *first.shape[1:]), dtype)
        offset = 0
        for url, part in zip(urls, parts, strict=True):
            rows = _conform(part[name], column, name, url, urls[0])
            _put_rows(column, slots[offset : offset + len(rows)], rows)
            offset += len(rows)
        out[name] = column
    return out, total


def _conform(rows: np.ndarray, like: np.ndarray, name: str, url: str, first_url: str) -> np.ndarray:
    if rows.shape[1:] != like.shape[1:]:
        raise SourceError(
            f"column {name!r} has row shape {rows.shape[1:]} in {url} but {like.shape[1:]} in {first_url}"
        )
    if rows.dtype == like.dtype:
        return rows
    if not np.can_cast(rows.dtype, like.dtype, "safe"):  # int64 into int8 would wrap: never silently
        raise SourceError(f"column {name!r} is {rows.dtype} in {url} but {like.dtype} in {first_url}")
    with np.errstate(all="ignore"):
        out = rows.astype(like.dtype)
        back = out.astype(rows.dtype)
    # NumPy's "safe" still rounds int64 beyond 2**53 into float64 and wraps a far date into ns.
    if rows.dtype.kind in "iumM" and not np.array_equal(back, rows, equal_nan=rows.dtype.kind in "mM"):
        raise SourceError(
            f"column {name!r} is {rows.dtype} in {url} but {like.dtype} in {first_url}, "
            f"which cannot hold some of its values exactly"
        )
    return out


def _put_rows(target: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """target[index] = rows, on one fixed-size record per row when possible.

    Viewing each row as one opaque record makes a multi-byte row a single scatter element,
    about three times faster than fancy-index assignment on a 2-D array (and assignment is
    about 15% faster than `np.put`, which divides once per element).
    """
    records, values = (_as_records(target), _as_records(rows)) if target.ndim > 1 else (None, None)
    if records is not None and values is not None:
        records[index] = values
    else:
        target[index] = rows


def _take_rows(column: np.ndarray, index: np.ndarray) -> np.ndarray:
    """column[index] along axis 0, gathering whole rows as single records when possible
    (about 1.7 times faster than `np.take(axis=0)` for 100-byte rows)."""
    records = _as_records(column) if column.ndim > 1 else None
    if records is None:
        return np.take(column, index, axis=0)
    return np.take(records, index).view(column.dtype).reshape(len(index), *column.shape[1:])


def _as_records(rows: np.ndarray) -> np.ndarray | None:
    """A 1-D view of a C-contiguous array with one opaque fixed-size record per row, or None."""
    width = rows.itemsize * int(np.prod(rows.shape[1:]))
    if rows.dtype == object or not rows.flags.c_contiguous or not width or not len(rows):
        return None
    return rows.reshape(len(rows), -1).view(np.dtype((np.void, width))).reshape(len(rows))

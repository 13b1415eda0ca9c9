"""A shuffle's data: a chain over a source, cut into parts that map tasks read and run.

Data is a `gl.Dataset` whose operators are per record (map, also random; filter, flat_map,
select, seed), a bare source, or files by name (the source `sources.detect` picks for each;
URLs with `storage_options=`). A part is rows [start, stop) of a source: a Parquet file's row
groups, a tar shard, else `PART_ROWS` rows; with a select, only the selected source indices in
it. A map task reads its part and runs the chain's maps on its records (`Plan.map_records`: the
Loader's own values and random streams), then makes columns by the Loader's collate rule. A part
with no map of Arrow blocks becomes columns by the sources' Arrow -> NumPy rule (`to_numpy`).
Tar sources with gzip shards (no index) are streamed shard by shard, counted once.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.dataset import Dataset
from globalloader.dataset.collate import collate
from globalloader.dataset.combine import Combined
from globalloader.dataset.index_plan import IndexPlan
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import to_numpy
from globalloader.sources.base import (
    ArrowBlocks,
    BatchReads,
    Blocks,
    KeepsBlocks,
    StreamedShards,
    capable,
    declared_fingerprint,
)
from globalloader.sources.detect import open_source

PART_ROWS = 65536  # rows per map task of a source with no blocks: fixed, so orders never depend on the machine
# What to do instead of each operator that needs the order of the records, or makes it.
_INSTEAD = {
    "batch": "ShufflingDataset cuts batches itself (batch_size=)",
    "bucket_batch": "ShufflingDataset cuts batches itself (batch_size=); bucket each trainer's rows if needed",
    "pack": "pack needs the records in their final order, which only a trainer sees: pack each trainer's batches",
    "shuffle": "ShufflingDataset shuffles every epoch itself (seed=)",
    "window_shuffle": "ShufflingDataset shuffles every epoch itself (seed=)",
    "shard": "ShufflingDataset gives each trainer its share itself (rank=, num_trainers=)",
    "cache": "map tasks run the maps every epoch, in the cluster",
}


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of `source` (`indices` of them with a select), run through the maps of
    `chain`, a chain's plan (None: none); `name` and `fingerprint` (the chain's) are what ranks compare."""

    name: str
    fingerprint: str
    start: int
    stop: int
    source: Any = field(repr=False, compare=False)
    chain: IndexPlan | None = field(default=None, repr=False, compare=False)
    streamed_shard: int | None = None  # a gzip tar shard of the source, read by its record stream
    indices: np.ndarray | None = field(default=None, repr=False, compare=False)  # sorted; None: all

    @property
    def rows(self) -> int:
        """Source records the part reads (before any filter or flat_map)."""
        return self.stop - self.start if self.indices is None else len(self.indices)


def parts_of(data: Any, columns: Sequence[str] | None, storage_options: dict[str, Any] | None) -> list[Part]:
    """The parts of `data` (see the module doc), in order; ArgumentError naming an operator
    that Ray cannot run per record."""
    return [part for source, chain in _sources(data, columns, storage_options) for part in _split(source, chain)]


def _sources(
    data: Any, columns: Sequence[str] | None, storage_options: dict[str, Any] | None
) -> list[tuple[Any, IndexPlan | None]]:
    """The sources to read, each with the chain whose maps run on its records (None: none);
    files of a columnar format read `columns` only."""
    named = isinstance(data, (str, os.PathLike)) or (
        isinstance(data, (list, tuple)) and all(isinstance(f, (str, os.PathLike)) for f in data)
    )
    if named:
        files = [data] if isinstance(data, (str, os.PathLike)) else data
        return [(open_source(f, storage_options, columns)[1], None) for f in files]
    if storage_options is not None:
        raise ArgumentError("storage_options= is for files; give it to the source itself")
    if isinstance(data, Dataset):
        plan = _per_record(data)
        return [(data.source, plan if plan.maps or plan.index_ops else None)]
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ArgumentError(
            f"ShufflingDataset needs files, a source (len() and [i]) or a gl.Dataset, got {type(data).__name__}"
        )
    return [(data, None)]


def _per_record(chain: Dataset) -> IndexPlan:
    """The chain's plan; an ArgumentError naming its first operator that is not per record, and
    what to do instead."""
    plan = chain.plan
    if not isinstance(plan, IndexPlan):
        raise ArgumentError("ShufflingDataset reads its source by index: Dataset.stream(...) has none; pass a source")
    if isinstance(chain.source, Combined):
        raise ArgumentError(f"ShufflingDataset reads one source, not {chain.source.describe()}: pass one source")
    for op in (*plan.index_ops, plan.cache, plan.batch, *plan.tail[:1]):
        name, *args = op.describe() if op is not None else ("select",)
        if name != "select":
            call = f"batch({args[0]})" if name == "batch" else f"{str(name).removeprefix('window_')}(...)"
            raise ArgumentError(f"{_INSTEAD[str(name)]}: remove .{call} from the chain")
    return plan


def _split(source: Any, chain: IndexPlan | None) -> list[Part]:
    fingerprint = declared_fingerprint(source)
    if fingerprint is None:
        raise ArgumentError(
            f"{type(source).__name__} has no `fingerprint` string: every rank must agree it reads the same data"
        )
    if chain is not None:
        fingerprint = chain.resume_fingerprint  # the source's, the select's and the maps'
    if capable(source, StreamedShards) and source.streamed:
        counts = [sum(1 for _ in source.iter_records([shard])) for shard in range(len(source.shards))]
        cuts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        names = [f"tar shard {url}" for url in source.shards]
        streamed: list[int | None] = list(range(len(source.shards)))
    else:
        streamed = []
        cuts, names = _blocks(source)
        cuts.append(len(source))
    selected = np.sort(chain.indices(0)) if chain is not None and chain.index_ops else None
    parts = []
    for name, (a, b), shard in itertools.zip_longest(names, itertools.pairwise(cuts), streamed):
        indices = None if selected is None else selected[np.searchsorted(selected, a) : np.searchsorted(selected, b)]
        parts.append(Part(name, fingerprint, a, b, source, chain, shard, indices))
    return parts


def _blocks(source: Any) -> tuple[list[int], list[str]]:
    """Where the source's parts start, and their names."""
    if capable(source, Blocks) and capable(source, ArrowBlocks):  # a file's row groups in one part
        starts = source.block_starts.tolist()
        firsts = [b for b in range(len(starts)) if source.block_origin(b)[1] == 0]
        return [starts[b] for b in firsts], [source.block_origin(b)[0] for b in firsts]
    if capable(source, Blocks):
        cuts = source.block_starts.tolist()
        return cuts, [f"{source!r} block {b}" for b in range(len(cuts))]
    cuts = list(range(0, len(source), PART_ROWS))
    return cuts, [f"{source!r} rows {a}.." for a in cuts]


def read_part(part: Part, columns: Sequence[str] | None, epoch: int = 0) -> dict[str, np.ndarray]:
    """The rows `part` makes in `epoch` (through the chain's maps) as {column: array}; SourceError
    naming the part if a column is missing."""
    source, chain = part.source, part.chain
    if (chain is None or not chain.maps) and capable(source, Blocks) and capable(source, ArrowBlocks):
        pa = _extras.require("pyarrow", "ray")
        starts = source.block_starts
        blocks = [b for b in range(len(starts)) if part.start <= starts[b] < part.stop]
        if not blocks:
            return {}
        table = pa.concat_tables([source.read_block(b) for b in blocks])
        _check_columns(part, columns, table.column_names)
        if part.indices is not None:  # a select's rows, in source-index order
            table = table.take(part.indices - part.start)
        return {name: to_numpy(table.column(name)) for name in columns or table.column_names}
    indices = np.arange(part.start, part.stop, dtype=np.int64) if part.indices is None else part.indices
    if part.streamed_shard is not None:
        shard = list(source.iter_records([part.streamed_shard]))
        records = [shard[i] for i in (indices - part.start).tolist()]
    else:
        if capable(source, KeepsBlocks):
            source.keep_blocks(1)  # a remote shard is fetched whole once, not a request per record
        records = source.read_many(indices) if capable(source, BatchReads) else [source[i] for i in indices.tolist()]
    if chain is not None:
        records = chain.map_records(epoch, zip(indices.tolist(), records, strict=True))
    return _to_columns(part, columns, records)


def _to_columns(part: Part, columns: Sequence[str] | None, records: list[Any]) -> dict[str, np.ndarray]:
    """Records as columns by the Loader's collate rule; text, bytes and other values an object
    column (the collate's Python list)."""
    bad = next((r for r in records if not isinstance(r, dict)), None)
    if bad is not None:
        raise ArgumentError(f"Ray shuffles records that are dicts of columns; {part.name} gave a {type(bad)}")
    if not records:
        return {}
    if columns is not None:
        _check_columns(part, columns, [c for c in columns if all(c in r for r in records)])
        records = [{c: r[c] for c in columns} for r in records]
    try:
        batch = collate(records)
    except ArgumentError as exc:
        raise ArgumentError(f"{part.name}: {exc}") from None
    out = {}
    for name, values in batch.items():
        if isinstance(values, np.ndarray):
            out[name] = values
            continue
        if isinstance(records[0][name], (dict, list, tuple)):
            raise ArgumentError(
                f"{part.name}: column {name!r} holds {type(records[0][name]).__name__} values; Ray shuffles "
                "columns of arrays, numbers, text or bytes: make it one or several columns in a map"
            )
        column = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            column[i] = value
        out[name] = column
    return out


def _check_columns(part: Part, columns: Sequence[str] | None, names: list[str]) -> None:
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise SourceError(f"{part.name} has no column(s) {missing}; it has {names}")

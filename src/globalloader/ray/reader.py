"""A shuffle's data as parts of public sources, each read whole into NumPy columns by a map task.

Data is any source, a bare `gl.Dataset` over one, or files (Parquet, or tar shards by their
`.tar` suffix; URLs with `storage_options=` read through `globalloader.storage`). A part is rows
[start, stop) of a source: a Parquet file's row groups, a tar shard, else `PART_ROWS` rows. Tar
sources with gzip shards (`.tar.gz`, `.tgz`: no index) are streamed shard by shard, counted once.
Arrow blocks become columns by the one Arrow -> NumPy rule (`sources._arrow_values.to_numpy`),
dict records object columns (None where a record lacks the field).
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
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import Parquet, TarShards, to_numpy
from globalloader.sources.base import ArrowBlocks, BatchReads, Blocks, KeepsBlocks, capable, declared_fingerprint

PART_ROWS = 65536  # rows per map task of a source with no blocks: fixed, so orders never depend on the machine
_GZIP_SUFFIXES = (".gz", ".tgz")
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of `source`; `name` and `fingerprint` are what ranks compare."""

    name: str
    fingerprint: str
    start: int
    stop: int
    source: Any = field(repr=False, compare=False)
    streamed_shard: int | None = None  # a gzip tar shard of `source`, read by its record stream


def parts_of(data: Any, columns: Sequence[str] | None, storage_options: dict[str, Any] | None) -> list[Part]:
    """The parts of `data` (see the module doc), in order."""
    return [part for source in _sources(data, columns, storage_options) for part in _split(source)]


def _sources(data: Any, columns: Sequence[str] | None, storage_options: dict[str, Any] | None) -> list[Any]:
    if isinstance(data, Dataset):
        if data._ops:
            raise ArgumentError(
                f"ShufflingDataset reads a gl.Dataset's source, but {data!r} has operators: the shuffle and "
                "the batches are Ray's; pass gl.Dataset(source) or the source itself"
            )
        data = data.source
    named = isinstance(data, (str, os.PathLike)) or (
        isinstance(data, (list, tuple)) and all(isinstance(f, (str, os.PathLike)) for f in data)
    )
    if named:
        cols = list(columns) if columns is not None else None
        return [
            TarShards(f, storage_options=storage_options)
            if os.fspath(f).lower().endswith(_TAR_SUFFIXES)
            else Parquet(f, columns=cols, storage_options=storage_options)
            for f in ([data] if isinstance(data, (str, os.PathLike)) else data)
        ]
    if storage_options is not None:
        raise ArgumentError("storage_options= is for files; give it to the source itself")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ArgumentError(
            f"ShufflingDataset needs files, a source (len() and [i]) or a gl.Dataset, got {type(data).__name__}"
        )
    return [data]


def _split(source: Any) -> list[Part]:
    fingerprint = declared_fingerprint(source)
    if fingerprint is None:
        raise ArgumentError(
            f"{type(source).__name__} has no `fingerprint` string: every rank must agree it reads the same data"
        )
    if isinstance(source, TarShards) and any(url.lower().endswith(_GZIP_SUFFIXES) for url in source.shards):
        counts = [sum(1 for _ in source.iter_records([shard])) for shard in range(len(source.shards))]
        cuts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        return [
            Part(f"tar shard {url}", fingerprint, a, b, source, shard)
            for shard, (url, (a, b)) in enumerate(zip(source.shards, itertools.pairwise(cuts), strict=True))
        ]
    length = len(source)
    if capable(source, Blocks) and capable(source, ArrowBlocks):  # a file's row groups in one part
        starts = source.block_starts.tolist()
        firsts = [b for b in range(len(starts)) if source.block_origin(b)[1] == 0]
        names = [source.block_origin(b)[0] for b in firsts]
        cuts = [starts[b] for b in firsts]
    elif capable(source, Blocks):
        cuts = source.block_starts.tolist()
        names = [f"{source!r} block {b}" for b in range(len(cuts))]
    else:
        cuts = list(range(0, length, PART_ROWS))
        names = [f"{source!r} rows {a}.." for a in cuts]
    return [Part(name, fingerprint, a, b, source) for name, a, b in zip(names, cuts, [*cuts[1:], length], strict=True)]


def read_part(part: Part, columns: Sequence[str] | None) -> dict[str, np.ndarray]:
    """Every row of `part` as {column: array}; SourceError naming the part if a column is missing."""
    source = part.source
    if capable(source, Blocks) and capable(source, ArrowBlocks):
        pa = _extras.require("pyarrow", "ray")
        starts = source.block_starts
        blocks = [b for b in range(len(starts)) if part.start <= starts[b] < part.stop]
        table = pa.concat_tables([source.read_block(b) for b in blocks]) if blocks else None
        names = table.column_names if table is not None else []
        _check_columns(part, columns, names)
        return {name: to_numpy(table.column(name)) for name in columns or names} if table is not None else {}
    if part.streamed_shard is not None:
        records = list(source.iter_records([part.streamed_shard]))
    else:
        if capable(source, KeepsBlocks):
            source.keep_blocks(1)  # a remote shard is fetched whole once, not a request per record
        indices = np.arange(part.start, part.stop, dtype=np.int64)
        records = source.read_many(indices) if capable(source, BatchReads) else [source[i] for i in indices.tolist()]
    fields: dict[str, None] = {}
    for record in records:
        if not isinstance(record, dict):
            raise ArgumentError(f"Ray shuffles records that are dicts of columns; {part.name} gave a {type(record)}")
        fields.update(dict.fromkeys(record))
    if records:
        _check_columns(part, columns, list(fields))
    out = {name: np.empty(len(records), dtype=object) for name in columns or fields}
    for name, column in out.items():
        column[:] = [record.get(name) for record in records]
    return out


def _check_columns(part: Part, columns: Sequence[str] | None, names: list[str]) -> None:
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise SourceError(f"{part.name} has no column(s) {missing}; it has {names}")

"""ArrowCopy: a local memory-mapped Arrow copy of a Parquet source, where every row is cheap.

Parquet compresses whole row groups, so reading one random row decodes its whole group: an exact
global shuffle over Parquet pays a group decode per row. The copy pays it once per machine.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import os
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import IO, Any, NamedTuple

import numpy as np
from tqdm import tqdm

from globalloader import _extras, _paths, storage
from globalloader._pids import alive
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources._columns import check_columnar
from globalloader.sources._mapped_columns import MappedColumns
from globalloader.sources._row_layout import LAYOUT_KEY, PACKED, VALUE, Layout, Step, Unpacker, read_record
from globalloader.sources.base import ArrowBlocks, Blocks, capable, check_index, check_indices, fingerprint_of
from globalloader.storage._fork import ProcessLocal
from globalloader.storage.cache import crc32_upto

_FORMAT = 1  # bump when the file layout or the meaning of its metadata changes
_META_KEY = b"globalloader.arrow_copy"


class _Block(NamedTuple):
    """One row group's part of the copy, ready to read rows from."""

    key_prefix: str  # "<file>:" as Parquet's keys start
    first_row: int  # the group's first row within its file
    unpack: Unpacker | None  # row -> its packed values
    steps: list[Step]  # how to build a record from them


class ArrowCopy(ProcessLocal):
    """The records of a `Parquet` source, read from a local memory-mapped Arrow copy.

    Made by `gl.Parquet(paths).local_copy(folder)` (or `ArrowCopy(parquet, folder)`). Records are
    the ones the source yields: the same keys, values, dtypes and null rules (see `Parquet`), in
    the same order; `block_starts` are the source's row groups. Any row costs about what a row
    read in order costs, so `Dataset(copy).shuffle(seed)`, the exact global shuffle, runs at
    about sequential speed. `fingerprint` is derived from the source's.

    The copy is an uncompressed Arrow IPC file (`path`), one record batch per row group, a row's
    numbers and text spans packed into one fixed-size record (a random row touches two or three
    cache lines, not one per column). It is written once (`progress`: a bar, None on a terminal)
    to a temporary name renamed when complete; its name hashes the files' locations, sizes,
    versions and the columns, so later constructions reuse it (`built` False) and a changed
    source is copied again. Default folder: the globalloader cache folder. Batches are gathered
    by column from the whole mapped file when `columnar` (`sources._mapped_columns`).

    Errors: files whose column types differ, an unwritable folder or a full disk raise
    SourceError naming the file or folder. Pickles by path; safe to fork.
    """

    def __init__(
        self, source: Any, folder: str | os.PathLike[str] | None = None, *, progress: bool | None = None
    ) -> None:
        self._reset()
        if not (capable(source, Blocks) and capable(source, ArrowBlocks)):
            raise ArgumentError(f"ArrowCopy copies a gl.Parquet source, got {type(source).__name__}")
        if folder is not None and not isinstance(folder, (str, os.PathLike)):
            raise ArgumentError(f"folder must be a str, a path or None, got {folder!r}")
        if progress is not None and not isinstance(progress, bool):
            raise ArgumentError(f"progress must be a bool or None, got {progress!r}")
        self.files: list[str] = list(source.files)
        self.columns: list[str] | None = source.columns
        self.int_columns_as_float: frozenset[str] = source.int_columns_as_float
        self.block_starts: np.ndarray = source.block_starts
        self.columnar: bool = source.columnar  # batches gathered by column: see read_columns
        self._len = len(source)
        self._starts = [*self.block_starts.tolist(), self._len]
        self._origins = [source.block_origin(b) for b in range(len(self.block_starts))]
        self.fingerprint: str = fingerprint_of("ArrowCopy", [source.fingerprint])
        versions = source.file_versions()
        where = _hash([str(_FORMAT), repr(self.columns), *(loc for loc, _, _ in versions)])
        self._content = _hash([where, *(f"{size}\t{version}" for _, size, version in versions)])
        base = pathlib.Path(folder) if folder is not None else _paths.cache_dir("arrow-copy")
        self.path = base / f"parquet-{where}-{self._content}.arrow"
        self.built = False  # whether this construction wrote the copy (False: reused one)
        if not self._open(verify=True):
            self._build(source, progress)
            self.built = True
            if not self._open(verify=False):
                raise SourceError(f"the Arrow copy {self.path} just written cannot be read back; delete it and retry")

    # -- process state --------------------------------------------------------------------------
    _PROCESS_ONLY = ("_pa", "_reader", "_map", "_blocks", "_mapped", "_decoded", "_lock")

    def _reset(self) -> None:
        self._pa = _extras.require("pyarrow", "parquet")
        self._reader: Any = None
        self._map: Any = None  # the mapped file the reader reads
        self._blocks: dict[int, _Block] = {}
        self._mapped: MappedColumns | None = None
        self._decoded: OrderedDict[tuple[int, str], list[Any]] = OrderedDict()
        self._lock = threading.Lock()
        storage.reset_in_forked_children(self)

    def _after_fork(self) -> None:
        # The mapping and the views into it stay valid in the child; a lock another thread held
        # at the fork would never be released there.
        self._lock = threading.Lock()

    # -- the file ---------------------------------------------------------------------------------
    def _expected_metadata(self) -> bytes:
        return f"{_FORMAT}:{self._content}:{len(self._origins)}:{self._len}".encode()

    @property
    def _checksum_path(self) -> pathlib.Path:
        return self.path.with_name(self.path.name + ".crc32")

    def _open(self, verify: bool = False) -> bool:
        """Map the copy; False if it is missing or is not the complete copy of this source
        (`verify`: nor when its bytes do not match the checksum written with it)."""
        pa = self._pa
        try:
            mapped = storage.memory_map(self.path)
            reader = pa.ipc.open_file(mapped)
        except (OSError, pa.ArrowInvalid):  # missing, or not an Arrow file (damaged): build again
            return False
        metadata = reader.schema.metadata or {}
        if (
            metadata.get(_META_KEY) != self._expected_metadata()
            or LAYOUT_KEY not in metadata
            or reader.num_record_batches != len(self._origins)
            or (verify and not self._intact(mapped.fileno()))
        ):
            return False
        self._layout = Layout.from_json(metadata[LAYOUT_KEY])
        self._reader, self._map = reader, mapped
        return True

    def _intact(self, fd: int) -> bool:
        """Whether the mapped file's CRC-32 is the one written beside it: a flipped byte that
        keeps the size and the Arrow framing is caught here, before any row is served."""
        try:
            expected = storage.read_whole(self._checksum_path).strip()  # bytes: a damaged sidecar need not be text
        except OSError:
            return False
        return f"{crc32_upto(fd, os.fstat(fd).st_size):08x}".encode() == expected

    def _build(self, source: Any, progress: bool | None) -> None:
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SourceError(f"cannot create the Arrow copy's folder {folder}: {exc.strerror}; pass folder=") from None
        self._remove_stale()
        try:
            # Durable: a machine's crash must never leave a copy the checksum then condemns.
            with storage.write_atomic(self.path, durable=True) as out:
                self._write(source, out.file, progress)
                out.file.flush()
                checksum = f"{crc32_upto(out.file.fileno(), out.file.tell()):08x}"
                # The checksum goes first: a copy is never without one.
                with storage.write_atomic(self._checksum_path, durable=True) as sidecar:
                    sidecar.write(checksum.encode())
        except OSError as exc:
            raise SourceError(
                f"cannot write the Arrow copy {self.path}: {exc.strerror or exc}; free space there or pass folder="
            ) from None

    def _write(self, source: Any, out: IO[bytes], progress: bool | None) -> None:
        pa = self._pa
        writer: Any = None
        schema: Any = None
        bar = tqdm(
            total=self._len,
            desc=f"Arrow copy of {len(self.files)} Parquet file(s)",
            unit="row",
            unit_scale=True,
            disable=None if progress is None else not progress,
            leave=False,
        )
        sink = pa.PythonFile(out, mode="w")  # not closed: `write_atomic` closes `out` when it renames it
        with bar:
            for block in range(len(self._origins)):
                table = source.read_block(block)
                columns = [_plain(column.combine_chunks()) for column in table.columns]
                if writer is None:
                    first = [(name, column.type) for name, column in zip(table.column_names, columns, strict=True)]
                    layout = Layout.plan(table.column_names, [t for _, t in first], self.int_columns_as_float)
                    arrays = layout.pack(columns)
                    schema = self._schema(layout, arrays)
                    writer = pa.ipc.new_file(sink, schema)
                else:
                    _check_types(first, table.column_names, columns, self._origins[block][0])
                    arrays = layout.pack(columns)
                try:
                    writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
                except pa.ArrowInvalid as exc:
                    file, first_row = self._origins[block]
                    raise SourceError(f"cannot copy the row group at row {first_row} of {file}: {exc}") from None
                bar.update(table.num_rows)
            if writer is None:  # no row group at all: an empty copy with the files' columns
                empty = source.read_table(0)
                layout = Layout.plan(empty.column_names, empty.schema.types, self.int_columns_as_float)
                arrays = layout.pack([_plain(column.combine_chunks()) for column in empty.columns])
                writer = pa.ipc.new_file(sink, self._schema(layout, arrays))
            writer.close()

    def _schema(self, layout: Layout, arrays: list[Any]) -> Any:
        pa = self._pa
        kept = [name for name, kind, _, _ in layout.columns if kind != VALUE]
        fields = [pa.field(name, array.type) for name, array in zip([*kept, PACKED], arrays, strict=False)]
        return pa.schema(fields, metadata={_META_KEY: self._expected_metadata(), LAYOUT_KEY: layout.to_json()})

    def _remove_stale(self) -> None:
        """Delete copies of earlier versions of the same files, and the temporary files of
        writers on this machine that died before finishing."""
        where = self.path.name.split("-")[1]
        for other in self.path.parent.glob(f"parquet-{where}-*.arrow*"):
            if other.name not in (self.path.name, self._checksum_path.name):
                with contextlib.suppress(OSError):
                    other.unlink()
        for tmp in self.path.parent.glob(f".parquet-{where}-*.tmp"):
            pid = _paths.temporary_writer(tmp.name)
            if pid is not None and not alive(pid):
                with contextlib.suppress(OSError):
                    tmp.unlink()

    # -- reading ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        block = bisect.bisect_right(self._starts, index) - 1
        view = self._blocks.get(block) or self._load_block(block)
        row = index - self._starts[block]
        return read_record(f"{view.key_prefix}{view.first_row + row}", view.unpack, view.steps, row)

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Every record in order."""
        for index in range(self._len):
            yield self[index]

    def read_columns(self, indices: np.ndarray) -> dict[str, Any]:
        """The batch of the records at `indices` (at least one), in that order, gathered from the
        whole mapped file at once (`sources._mapped_columns`): what collating their records
        gives. Only when `columnar`."""
        check_columnar(self)
        idx = check_indices(indices, self._len, self)
        if self._mapped is None:
            batches = [self._batch(b) for b in range(len(self._origins))]
            with self._lock:
                self._map.seek(0)
                mapped = np.frombuffer(self._map.read_buffer(self._map.size()), dtype=np.uint8)
            origins = (
                np.array([self.files.index(file) for file, _ in self._origins], dtype=np.int64),
                np.array([first_row for _, first_row in self._origins], dtype=np.int64),
                [f"{file}:" for file in self.files],
            )
            where = f"the Arrow copy {self.path}"
            self._mapped = MappedColumns(mapped, self._layout, batches, self.block_starts, self._len, origins, where)
        return self._mapped.gather(idx)

    def _load_block(self, block: int) -> _Block:
        batch = self._batch(block)
        file, first_row = self._origins[block]
        steps = self._layout.steps(batch, self._decoded, block)
        view = self._blocks[block] = _Block(f"{file}:", first_row, self._layout.unpacker(batch), steps)
        return view

    def _batch(self, block: int) -> Any:
        """Row group `block`'s record batch, mapped from the file."""
        with self._lock:
            if self._reader is None and not self._open():
                raise SourceError(
                    f"the Arrow copy {self.path} is gone or was replaced (its source changed?); "
                    "make the copy again with Parquet(...).local_copy()"
                )
            batch = self._reader.get_batch(block)
        expected = self._starts[block + 1] - self._starts[block]
        if batch.num_rows != expected:
            raise SourceError(f"the Arrow copy {self.path} is damaged (row group {block}); delete it to rebuild it")
        return batch

    def __repr__(self) -> str:
        return f"ArrowCopy({len(self.files)} files, {self._len} rows, {self.path})"


# -- helpers --------------------------------------------------------------------------------------------


def _plain(column: Any) -> Any:
    """Dictionary-encoded columns decoded: an Arrow file holds one dictionary per column, and
    row groups each have their own; the values read back are the same."""
    pa = _extras.require("pyarrow", "parquet")
    if pa.types.is_dictionary(column.type):
        return column.dictionary_decode()
    return column


def _check_types(first: list[tuple[str, Any]], names: list[str], columns: list[Any], file: str) -> None:
    for name, column, (first_name, first_type) in zip(names, columns, first, strict=True):
        if name != first_name or column.type != first_type:
            raise SourceError(
                f"{file}: column {name!r} is {column.type}, other files have {first_name!r} as {first_type}; "
                "an Arrow copy needs one schema: select columns or rewrite the files with one type"
            )


def _hash(parts: list[str]) -> str:
    digest = hashlib.sha256("\n".join(parts).encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]

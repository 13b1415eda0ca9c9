"""HFDataset: a Hugging Face `datasets` dataset read in place from its memory-mapped Arrow files.

`datasets` keeps a dataset as Arrow IPC *stream* files (`save_to_disk`'s `data-XXXXX-of-YYYYY.arrow`,
the load cache's `cache-*.arrow`) beside JSON: `state.json` lists the files, `dataset_info.json`
holds the features (which columns are images, class labels, fixed-shape arrays). Both are read
here with pyarrow alone, so a folder needs no `datasets` installed.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from globalloader import _extras, storage
from globalloader.errors import ArgumentError, SourceError, check_int
from globalloader.sources._arrow_values import is_bytes, is_exact, is_list, is_text, to_numpy
from globalloader.sources._columns import BlockGather, batch_values, check_columnar, gatherable
from globalloader.sources._row_layout import GETTER, VALUE, Getter, Layout, Step, Unpacker, read_record
from globalloader.sources.base import check_index, check_indices, fingerprint_of
from globalloader.storage._fork import ProcessLocal

ENCODED_FEATURES = frozenset({"Image", "Audio", "Video", "Pdf"})  # struct {bytes, path}: records get the bytes
ARRAY_FEATURES = frozenset({"Array2D", "Array3D", "Array4D", "Array5D"})
_READ_FEATURES = ENCODED_FEATURES | ARRAY_FEATURES | {"Value", "ClassLabel", "List", "Sequence", "LargeList"}
_READ_FEATURES |= {"Translation", "TranslationVariableLanguages"}
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # what a completely written Arrow stream ends with

_Decoded = tuple[Unpacker | None, list[Step]]  # (row -> packed numbers, steps)
_GATHER_ROWS = 8192


class HFDataset(ProcessLocal):
    """The rows of a Hugging Face dataset, addressable by global row index.

    `path_or_dataset`: a folder written by `Dataset.save_to_disk` (read without `datasets`), or a
    `datasets.Dataset` whose rows are its cache files (`load_dataset`, `load_from_disk`, `map`);
    one whose rows are an index mapping over them (after `shuffle`, `select`, `filter`, `sort`)
    or held in memory is an ArgumentError saying what to call first. A DatasetDict folder is an
    ArgumentError naming its splits. `columns`: the columns to read (default all).

    A record is `{"__key__": f"{file}:{row}", <column>: value, ...}` (`row` counts within the
    Arrow file), with the values and null rules of `gl.Parquet`: Python numbers, text and bytes
    (a null in a float column is NaN; an integer column holding a null anywhere is float64 with
    NaN), lists of numbers as NumPy arrays, dicts for nested features. Features add three rules:
    `ClassLabel` is its int; `Array2D`..`Array5D` are NumPy arrays of the feature's shape;
    `Image`, `Audio`, `Video` and `Pdf` are their encoded bytes (JPEG bytes decode on the fast
    path), and where the dataset holds only the file's path, the bytes of that file (a relative
    path from the current folder, as `datasets` opens it); None when neither is set.

    The files are memory-mapped: no row is copied into the process until read, and every worker
    shares the page cache. Blocks (`block_starts`) are the files' record batches, so
    `shuffle(window=)` reads batch by batch; batches of a chain that only batches the rows are
    gathered by column when `columnar` (`sources._columns`). `fingerprint`: the files' paths,
    sizes and modification times, and the columns.

    Errors (SourceError naming the file): a missing folder, `state.json` or `dataset_info.json`;
    an Arrow file missing, truncated or damaged, or changed since the source was made; a feature
    type this reader does not know, or a column not stored as its feature says. Needs pyarrow (the `parquet` extra).
    """

    def __init__(self, path_or_dataset: Any, columns: list[str] | None = None, *, cached_blocks: int = 256) -> None:
        self._reset()
        if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
            raise ArgumentError(f"columns must be a list of str or None, got {columns!r}")
        self.cached_blocks = check_int(cached_blocks, "cached_blocks", 1)
        if isinstance(path_or_dataset, (str, os.PathLike)):
            self.where = os.fspath(path_or_dataset)
            files, features = _saved_folder(self.where)
            available, rows, table_schema = list(features), None, None
        else:
            files, features, available, rows, table_schema = _dataset_object(path_or_dataset)
            self.where = f"the datasets.Dataset over {files[0]}"
        if columns is not None:
            unknown = [c for c in columns if c not in available]
            if unknown:
                raise ArgumentError(f"{self.where} has no column(s) {unknown}; it has {available}")
        self.columns: list[str] = list(columns) if columns is not None else available
        for name in self.columns:
            _check_feature(features[name], name, self.where)
        self._encoded = {c for c in self.columns if _type_of(features[c]) in ENCODED_FEATURES}
        self._shapes = {c: _shape(features[c]) for c in self.columns if _type_of(features[c]) in ARRAY_FEATURES}
        self.files: list[str] = [os.path.abspath(f) for f in files]
        self.store = storage.Store()
        self._types: list[Any] = []  # the selected columns' Arrow types, encoded features as binary
        self._stats = [self.store.stat(f) for f in self.files]
        scans = [self._scan(f, table_schema) for f in range(len(self.files))]
        starts, owners, with_nulls = [0], [], set()
        for f, (batch_rows, nulls) in enumerate(scans):
            in_file = 0
            for b, count in enumerate(batch_rows):
                owners.append((f, b, in_file))
                starts.append(starts[-1] + count)
                in_file += count
            with_nulls |= nulls
        self._len = starts[-1]
        if rows is not None and rows != self._len:
            raise ArgumentError(
                f"{self.where} has {rows} rows but its cache files hold {self._len}: its rows are not its files' "
                "(a select or a slice); call flatten_indices() on it first, or save_to_disk and pass the folder"
            )
        self._starts = starts
        self._owners: list[tuple[int, int, int]] = owners  # (file, record batch, first row in file)
        self.block_starts: np.ndarray = np.array(starts[:-1], dtype=np.int64)
        self.block_starts.setflags(write=False)
        self.int_columns_as_float: frozenset[str] = frozenset(with_nulls)
        self._origins = (
            np.array([f for f, _, _ in owners], dtype=np.int64),
            np.array([r for _, _, r in owners], dtype=np.int64),
            [f"{path}:" for path in self.files],
        )
        self._layout = Layout.plan(self.columns, self._types, self.int_columns_as_float)  # alike in every block
        self.columnar: bool = not self._shapes and all(
            gatherable(kind, name in self.int_columns_as_float)
            for name, kind in zip(self.columns, self._types, strict=True)
        )
        # Rows one read_columns_ahead call may gather (dataset.gather_ahead): about 16 MiB of the files.
        stored = sum(stat.size for stat in self._stats)
        self.gather_rows = int(min(_GATHER_ROWS, (16 << 20) * max(1, self._len) // max(1, stored)))
        versions = (
            f"{storage.cache_key(u)}\t{s.size}\t{s.version}" for u, s in zip(self.files, self._stats, strict=True)
        )
        self.fingerprint: str = fingerprint_of("HFDataset", [f"columns={self.columns}", *versions])

    _PROCESS_ONLY = ("_pa", "_files_read", "_validated", "_blocks", "_decoded", "_gather", "_reader", "_lock")

    def _reset(self) -> None:
        self._pa = _extras.require("pyarrow", "parquet")
        self._files_read: dict[int, list[Any]] = {}  # file -> its record batches, views into the mapping
        self._validated: set[int] = set()  # blocks whose every offset and value was checked here
        self._blocks: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._decoded: OrderedDict[tuple[int, str], list[Any]] = OrderedDict()
        self._gather: BlockGather | None = None
        self._reader: storage.RangeReader | None = None
        self._lock = threading.Lock()
        storage.reset_in_forked_children(self)

    def _after_fork(self) -> None:
        # The mappings and the views into them stay valid in the child; a held lock would not.
        self._lock = threading.Lock()

    # -- the files ----------------------------------------------------------------------------------
    def _scan(self, f: int, table_schema: Any) -> tuple[list[int], set[str]]:
        """One file's record batch sizes and the integer columns holding a null (both from the
        batches' headers, no data read); its schema's types are kept as the source's, and must
        be `table_schema`'s (a `datasets.Dataset`'s table, else None)."""
        path, pa = self.files[f], self._pa
        try:
            with storage.memory_map(path) as mapped:
                reader = pa.ipc.open_stream(mapped)
                names = reader.schema.names
                if table_schema is not None and (
                    any(c not in names for c in self.columns)
                    or self._types_in(reader.schema, path) != self._types_in(table_schema, path)
                ):
                    raise ArgumentError(
                        f"{self.where} has columns its cache files do not (a rename, cast or new column held in "
                        "memory): save_to_disk it and pass the folder"
                    )
                types = self._types_in(reader.schema, path)
                if f and types != self._types:
                    raise SourceError(f"Arrow file {path} has other column types than {self.files[0]}: {types}")
                self._types = types
                exact = [c for c, t in zip(self.columns, types, strict=True) if is_exact(t)]
                batch_rows: list[int] = []
                nulls: set[str] = set()
                for batch in reader:
                    batch_rows.append(batch.num_rows)
                    nulls.update(c for c in exact if batch.column(c).null_count)
                mapped.seek(max(0, mapped.size() - len(_END_OF_STREAM)))
                complete = mapped.read(len(_END_OF_STREAM)) == _END_OF_STREAM
        except (OSError, pa.ArrowInvalid) as exc:
            raise SourceError(f"cannot read the Arrow file {path}: {exc}") from None
        if not complete:
            raise SourceError(
                f"Arrow file {path} ends before its end-of-stream marker: it is truncated; write it again"
            )
        return batch_rows, nulls

    def _types_in(self, schema: Any, path: str) -> list[Any]:
        """The selected columns' types in `schema` (encoded features as their bytes), or the
        SourceError naming the columns file `path` lacks."""
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise SourceError(f"Arrow file {path} has no column(s) {missing}; it has {schema.names}")
        types = [_storage_type(schema.field(c).type) for c in self.columns]
        for name, kind in zip(self.columns, types, strict=True):
            if not self._stored_as_its_feature(name, kind):
                raise SourceError(
                    f"Arrow file {path}: column {name!r} is stored as {kind}, which is not how datasets stores "
                    "its feature (dataset_info.json); write the dataset again, or leave it out with columns=[...]"
                )
        return [self._pa.binary() if c in self._encoded else t for c, t in zip(self.columns, types, strict=True)]

    def _stored_as_its_feature(self, name: str, kind: Any) -> bool:
        """An Image/Audio column is a struct of `bytes` and `path`; an `ArrayND` column lists of
        lists, one level per dimension, of numbers."""
        pa = self._pa
        if name in self._encoded:
            fields = (
                {kind.field(i).name: kind.field(i).type for i in range(kind.num_fields)}
                if pa.types.is_struct(kind)
                else {}
            )
            return is_bytes(fields.get("bytes", pa.null())) and is_text(fields.get("path", pa.null()))
        if name in self._shapes:
            for _ in self._shapes[name]:
                if not is_list(kind):
                    return False
                kind = kind.value_type
            return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))
        return True

    def _batches(self, f: int) -> list[Any]:
        """File `f`'s record batches mapped in this process (no copy), checked against the scan."""
        batches = self._files_read.get(f)
        if batches is not None:
            return batches
        path, pa = self.files[f], self._pa
        with self._lock:
            if self.store.stat(path) != self._stats[f]:
                raise SourceError(f"Arrow file {path} changed since the source was made; make the source again")
            try:
                batches = list(pa.ipc.open_stream(storage.memory_map(path)))
            except (OSError, pa.ArrowInvalid) as exc:
                raise SourceError(f"cannot read the Arrow file {path}: {exc}") from None
            expected = [self._starts[b + 1] - self._starts[b] for b, owner in enumerate(self._owners) if owner[0] == f]
            if [batch.num_rows for batch in batches] != expected:
                raise SourceError(f"Arrow file {path} changed since the source was made; make the source again")
            self._files_read[f] = batches
        return batches

    def _columns(self, block: int) -> list[Any]:
        """The selected columns of record batch `block`, checked whole (a damaged offset is an
        error here, never a wrong value), encoded features as their bytes."""
        f, b, _ = self._owners[block]
        batch = self._batches(f)[b]
        if block not in self._validated:
            try:
                batch.validate(full=True)
            except self._pa.ArrowInvalid as exc:
                raise SourceError(f"Arrow file {self.files[f]} is damaged (record batch {b}): {exc}") from None
            self._validated.add(block)
        columns = []
        for name in self.columns:
            column = batch.column(name)
            if isinstance(column, self._pa.ExtensionArray):  # datasets' own types, when datasets is imported
                column = column.storage
            columns.append(self._encoded_bytes(column, name, block) if name in self._encoded else column)
        return columns

    def _encoded_bytes(self, column: Any, name: str, block: int) -> Any:
        """An Image/Audio column's bytes; where a row has only a path, that file's bytes."""
        if not column.null_count:  # the usual case: the bytes child as it is, no compute
            data = column.field("bytes").slice(column.offset, len(column))  # a child ignores its parent's offset
            if not data.null_count:
                return data
        pc = _extras.require("pyarrow.compute", "parquet")
        data, paths = pc.struct_field(column, "bytes"), pc.struct_field(column, "path")
        if not pc.any(pc.and_(data.is_null(), paths.is_valid())).as_py():
            return data
        values = data.to_pylist()
        for row, path in enumerate(paths.to_pylist()):
            if values[row] is None and path is not None:
                values[row] = self._read_file(path, name, block, row)
        return self._pa.array(values, self._pa.binary())

    def _read_file(self, path: str, name: str, block: int, row: int) -> bytes:
        if self._reader is None:
            self._reader = storage.RangeReader(self.store)
        try:
            return self._reader.read(path, 0, self.store.stat(path).size)
        except SourceError as exc:
            key = self._key(block, row)
            raise SourceError(
                f"record {key}: column {name!r} has no bytes and its file {path} cannot be read: {exc}"
            ) from None

    # -- reading ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        block = bisect.bisect_right(self._starts, index) - 1
        unpack, steps = self._cached("rows", block, self._decode_rows)
        row = index - self._starts[block]
        return read_record(self._key(block, row), unpack, steps, row)

    def _key(self, block: int, row: int) -> str:
        f, _, first_row = self._owners[block]
        return f"{self.files[f]}:{first_row + row}"

    def read_columns(self, indices: np.ndarray) -> dict[str, Any]:
        """The batch of the records at `indices`, gathered column by column (see `gl.Parquet`)."""
        check_columnar(self)
        return self._gatherer()(check_indices(indices, self._len, self))

    def read_columns_ahead(self, parts: list[np.ndarray]) -> list[dict[str, Any]]:
        """`read_columns` of the leading parts whose rows lie in the blocks of the first part."""
        check_columnar(self)
        return self._gatherer().ahead([check_indices(part, self._len, self) for part in parts])

    def _gatherer(self) -> BlockGather:
        if self._gather is None:
            self._gather = BlockGather(self.columns, self.block_starts, self._len, self._origins, self._gathered)
        return self._gather

    def _gathered(self, block: int) -> list[Any]:
        return self._cached("columns", block, self._decode_columns)

    def _cached(self, form: str, block: int, decode: Any) -> Any:
        """Block `block` ready for reads by row or by column (`form`), from the per-process LRU."""
        key = (form, block)
        cached = self._blocks.get(key)
        if cached is None:
            cached = self._blocks[key] = decode(block)
            with contextlib.suppress(KeyError):  # another thread evicted it first
                while len(self._blocks) > self.cached_blocks:
                    self._blocks.popitem(last=False)
        return cached

    def _decode_rows(self, block: int) -> _Decoded:
        """A block laid out for reads by row (`sources._row_layout`): numbers and the spans of
        text and bytes packed per row, values sliced from the mapped data."""
        columns = self._columns(block)
        layout = self._layout
        kept = [(name, c) for c, (name, kind, _, _) in zip(columns, layout.columns, strict=True) if kind != VALUE]
        batch = self._pa.RecordBatch.from_arrays([c for _, c in kept], names=[n for n, _ in kept])
        steps = layout.steps(batch, self._decoded, block)
        for k, (name, _, _, _) in enumerate(steps):
            if name in self._shapes:
                steps[k] = (name, GETTER, -1, self._array_rows(columns[self.columns.index(name)], name, block))
        return layout.unpacker_of(layout.records(columns)), steps

    def _decode_columns(self, block: int) -> list[Any]:
        return [
            batch_values(column, name, name in self.int_columns_as_float)
            for name, column in zip(self.columns, self._columns(block), strict=True)
        ]

    def _array_rows(self, column: Any, name: str, block: int) -> Getter:
        """Rows of an `ArrayND` column as arrays of its shape (a first dimension of None varies
        by row): views of the mapped numbers, read-only."""
        pc = _extras.require("pyarrow.compute", "parquet")
        shape = self._shapes[name]
        inner = int(np.prod([int(d or 0) for d in shape[1:]]))
        items = column.values  # the first dimension's entries, of the whole batch
        for _ in shape[1:]:
            items = pc.list_flatten(items)
        if len(items) != len(column.values) * inner:
            f, b, _ = self._owners[block]
            raise SourceError(f"Arrow file {self.files[f]} (record batch {b}): column {name!r} is not of shape {shape}")
        numbers, at = to_numpy(items), column.offsets.to_numpy().item
        valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False)).item if column.null_count else None
        rest = tuple(int(d or 0) for d in shape[1:])

        def get(row: int) -> Any:
            if valid is not None and not valid(row):
                return None
            start, end = at(row), at(row + 1)
            return numbers[start * inner : end * inner].reshape(end - start, *rest)

        return get

    # -- blocks -----------------------------------------------------------------------------------
    def keep_blocks(self, count: int) -> None:
        """Keep at least `count` blocks laid out per process (a windowed shuffle reads its window)."""
        self.cached_blocks = max(self.cached_blocks, int(count))

    def __repr__(self) -> str:
        return f"HFDataset({len(self.files)} files, {self._len} rows)"


# -- the dataset's description ----------------------------------------------------------------------


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(storage.read_whole(path))
    except FileNotFoundError:
        raise SourceError(f"{path} is missing: {what}") from None
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot read {path}: {exc}") from None


def _saved_folder(folder: str) -> tuple[list[str], dict[str, Any]]:
    """The Arrow files and features of a folder written by `save_to_disk`."""
    if not os.path.isdir(folder):
        raise SourceError(f"no folder {folder}: gl.HFDataset reads a folder written by Dataset.save_to_disk")
    splits_file = os.path.join(folder, "dataset_dict.json")
    if os.path.exists(splits_file):
        splits = _read_json(splits_file, "").get("splits", [])
        raise ArgumentError(
            f"{folder} holds a DatasetDict with splits {splits}: pass one split's folder, "
            f"e.g. gl.HFDataset({os.path.join(folder, str(splits[0]) if splits else 'train')!r})"
        )
    state = _read_json(os.path.join(folder, "state.json"), "not a folder written by Dataset.save_to_disk")
    info = _read_json(os.path.join(folder, "dataset_info.json"), "save_to_disk writes it beside state.json")
    try:
        files = [os.path.join(folder, entry["filename"]) for entry in state["_data_files"]]
        features = dict(info["features"])
    except (KeyError, TypeError, ValueError):
        raise SourceError(f"{folder}: state.json lacks _data_files or dataset_info.json lacks features") from None
    if not files:
        raise SourceError(f"{folder}: state.json lists no Arrow file")
    return files, features


def _dataset_object(dataset: Any) -> tuple[list[str], dict[str, Any], list[str], int, Any]:
    """The cache files, features, columns, rows and table schema of a `datasets.Dataset` whose
    rows are its files."""
    if not all(hasattr(dataset, name) for name in ("cache_files", "features", "column_names", "num_rows")):
        raise ArgumentError(
            "path_or_dataset must be a folder written by save_to_disk or a datasets.Dataset, "
            f"got {type(dataset).__name__}"
        )
    if getattr(dataset, "_indices", None) is not None:
        raise ArgumentError(
            "this datasets.Dataset reads its rows through an index mapping (after shuffle, select, filter or sort): "
            "call flatten_indices() on it first, or use gl's own shuffle on the unshuffled dataset"
        )
    files = [entry["filename"] for entry in dataset.cache_files]
    if not files:
        raise ArgumentError(
            "this datasets.Dataset is held in memory, with no Arrow file: save_to_disk it, pass the folder"
        )
    features = dataset.features.to_dict()
    return files, features, list(dataset.column_names), int(dataset.num_rows), dataset.data.schema


def _type_of(feature: Any) -> str | None:
    return feature.get("_type") if isinstance(feature, dict) else None


def _check_feature(feature: Any, name: str, where: str) -> None:
    """Refuse a feature type this reader does not know (a newer `datasets`, a custom type): its
    values' meaning would be a guess."""
    if isinstance(feature, list):  # the older form of a sequence: [feature]
        for item in feature:
            _check_feature(item, name, where)
        return
    if not isinstance(feature, dict):
        raise SourceError(f"{where}: column {name!r} has a feature that is not a dict: {feature!r}")
    kind = feature.get("_type")
    if kind is None:  # a dict of features
        for key, item in feature.items():
            _check_feature(item, f"{name}.{key}", where)
    elif kind not in _READ_FEATURES:
        raise SourceError(
            f"{where}: column {name!r} has feature type {kind!r}, which gl.HFDataset does not read; "
            "leave it out with columns=[...]"
        )
    elif "feature" in feature:
        _check_feature(feature["feature"], name, where)


def _shape(feature: dict[str, Any]) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in feature["shape"])


def _storage_type(kind: Any) -> Any:
    pa = _extras.require("pyarrow", "parquet")
    return kind.storage_type if isinstance(kind, pa.ExtensionType) else kind

"""`write_shards`: run a chain with a Loader's workers and write its samples as shards, resumably.

With `maxcount` alone, shard k is samples [k*maxcount, (k+1)*maxcount) of the chain: the chain
is batched by maxcount and each batch is written whole by a worker (`ShardWriter`: encoding, tar
headers, MD5 and CRC all in the worker, and the file itself when local), the main process only
publishing the shards in order; this is the fast path. With `maxsize`, where a shard ends
depends on the sizes, the main process writes the samples as they come (the workers run the
chain). Either way the Loader yields in the chain's order whatever its worker count, so the
bytes written depend on the chain alone. Completion is recorded in a manifest beside the shards
(`manifest_url`), rewritten whole after each finished shard: the shards it lists, their samples
and sizes, and the Loader's state after the last of them. A run started again with the same
call continues from that state with the next shard number; shards are published whole
(`storage.Store.open_write`, `Store.publish`), so a killed run leaves at most a finished shard
the manifest does not list yet, which the next run writes again with the same bytes, and
temporary files beside the shards that it removes.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import uuid
from typing import Any

from tqdm.auto import tqdm

from globalloader import storage
from globalloader.dataset.chain import Dataset
from globalloader.dataset.resume import make_state
from globalloader.errors import ArgumentError, SourceError, StateError
from globalloader.execution.loader import Loader
from globalloader.sources import _tar_index, parquet_writer, tar_writer
from globalloader.sources._shard_series import check_limits, number_field
from globalloader.sources.parquet_writer import ParquetWriter
from globalloader.sources.tar_writer import TarWriter

WRITERS: dict[str, type[TarWriter | ParquetWriter]] = {"tar": TarWriter, "parquet": ParquetWriter}
DEFAULT_MAXSIZE = 256 << 20  # bytes per shard when neither maxcount nor maxsize is given
_MANIFEST_FORMAT, _MANIFEST_VERSION = "globalloader-shards", 1
_MANIFEST_MAX = 64 << 20  # bytes: a larger manifest is not one this module wrote


def write_shards(
    dataset: Dataset,
    pattern: str | os.PathLike[str],
    workers: int = 0,
    *,
    maxcount: int | None = None,
    maxsize: int | None = None,
    storage_options: dict[str, Any] | None = None,
    format: str = "tar",
    on_error: str = "raise",
    progress: bool = True,
    **loader_options: Any,
) -> list[str]:
    """Write the samples of `dataset` (a chain of dict samples, not batched) into shards named
    by `pattern` (with a number field: `out/shard-%06d.tar`, or an `s3://...` URL), computing
    them with a `Loader(dataset, workers, on_error=on_error, **loader_options)`; returns every
    shard's path, in order.

    `format="tar"`: WebDataset tar shards with their `.idx` sidecars (`TarWriter`; a sample's
    `__key__` becomes tar-safe: dots in its last part turn to `_`, a leading `/` goes, and a
    sample without one is keyed by its position, `%09d`). `format="parquet"`: Parquet files
    (`ParquetWriter`). A shard rolls over at `maxcount` samples or `maxsize` bytes (default
    256 MB when neither is given). With `maxcount` alone each worker writes whole shards (it
    holds a shard's samples in memory while it writes them) and the main process publishes
    them, the fast path; with `maxsize` the main process writes every sample. Each shard
    appears whole when finished, uploaded as it completes for object storage; `progress`
    shows a bar.

    Killed at any point and called again the same way, it continues after the last finished
    shard and ends with the same bytes as a run never stopped; a finished shard is not written
    again. The manifest beside the shards (see `manifest_url`) records this; a call that does
    not match it (another chain, format, maxcount or maxsize) is an ArgumentError naming it.
    A map's error stops the run with the shard in progress dropped (TransformError, naming
    the sample); `on_error="skip"` leaves bad samples out instead, with a warning.
    """
    if not isinstance(dataset, Dataset):
        raise ArgumentError(f"write_shards: dataset must be a globalloader.Dataset, got {type(dataset).__name__}")
    if format not in WRITERS:
        raise ArgumentError(f"write_shards: format must be one of {sorted(WRITERS)}, got {format!r}")
    if dataset.plan.batch is not None:
        raise ArgumentError("write_shards writes samples: give it the chain before .batch()")
    if not isinstance(pattern, (str, os.PathLike)):
        raise ArgumentError(f"write_shards: pattern must be a str or path, got {type(pattern).__name__}")
    pattern = os.fspath(pattern)
    manifest = manifest_url(pattern)
    check_limits(maxcount, maxsize)
    if maxcount is None and maxsize is None:
        maxsize = DEFAULT_MAXSIZE
    identity = {
        "chain": dataset.plan.resume_fingerprint,
        "shard_format": format,
        "pattern": posixpath.basename(pattern.replace(os.sep, "/")),
        "maxcount": maxcount,
        "maxsize": maxsize,
    }
    chain = dataset
    if maxcount is not None and maxsize is None:  # boundaries known in advance: a worker writes each shard
        chain = dataset.batch(maxcount, collate=list).map(ShardWriter(format, pattern), name="write-shard")
    loader = Loader(chain, workers, on_error=on_error, **loader_options)  # checks its arguments; starts nothing
    store = storage.Store(storage_options)
    done = _finished(store, manifest, identity)
    if done is not None and done["complete"]:
        return [shard["path"] for shard in done["shards"]]
    shards: list[dict[str, Any]] = done["shards"] if done is not None else []
    if done is not None:
        try:
            loader.load_state_dict(done["state"])
        except StateError as exc:
            raise StateError(f"{manifest}: {exc}; delete the manifest and its shards to start over") from None
    if not storage.scheme_of(pattern):  # what a killed run was writing: the next shards, the manifest
        for url in (pattern % len(shards), pattern % (len(shards) + 1), manifest):
            for temporary in storage.stale_temporaries(url):  # the manifest's: the workers' shards too
                os.unlink(temporary)
    record = _Record(store, manifest, identity, shards)
    bar = tqdm(total=_length(dataset), initial=record.samples(), unit="sample", desc=pattern, disable=not progress)
    try:
        if chain is not dataset:
            _publish_shards(loader, pattern, record, bar)
        else:
            _write_samples(loader, pattern, record, bar, format, maxcount, maxsize)
    finally:
        bar.close()
        loader.close()
        if not storage.scheme_of(pattern):  # shards the workers wrote that were not published
            for temporary in storage.stale_temporaries(manifest):
                os.unlink(temporary)
    return [shard["path"] for shard in shards]


class ShardWriter:
    """The map a worker runs on a shard's samples (a batch of maxcount): it builds the whole
    shard (a tar and its sidecar, or a Parquet file), so the main process only publishes it.
    A local shard goes to a temporary file beside the shards, named after the manifest (so the
    next run removes a killed run's), whose path comes back for the main process to rename
    into place; a remote shard's bytes come back for it to upload. A bad sample comes back as
    its ArgumentError (raised by the main process, never skipped with the shard by
    `on_error="skip"`); tar samples without a key come back as they are, for the main process
    to key by their position, which only it knows."""

    def __init__(self, format: str, pattern: str) -> None:
        self.format, self.pattern = format, pattern

    def __call__(self, samples: list[Any]) -> tuple[bytes | str, bytes | None, int] | list[Any] | ArgumentError:
        try:
            if self.format == "parquet":
                rows = [parquet_writer.sample_row(s) for s in samples]
                parts, index = [parquet_writer.file_bytes(rows, self.pattern)], None
            else:
                keyed = [_tar_safe(s) for s in samples]
                if any(not isinstance(s, dict) or s.get("__key__") is None for s in keyed):
                    return keyed
                parts, index = tar_writer.shard_parts(keyed, self.pattern)
        except ArgumentError as exc:
            return exc
        if storage.scheme_of(self.pattern):
            buffer = io.BytesIO()
            sidecar = tar_writer.write_parts(parts, index, buffer)
            return buffer.getvalue(), sidecar, len(samples)
        folder, name = os.path.split(manifest_url(self.pattern))
        temporary = os.path.join(folder, f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            os.makedirs(folder or ".", exist_ok=True)
            with open(temporary, "wb") as out:
                sidecar = tar_writer.write_parts(parts, index, out)
        except OSError as exc:
            raise SourceError(f"cannot write {temporary}: {exc.strerror}") from None
        return temporary, sidecar, len(samples)


class _Record:
    """The shards finished so far, and the manifest that records them."""

    def __init__(
        self, store: storage.Store, manifest: str, identity: dict[str, Any], shards: list[dict[str, Any]]
    ) -> None:
        self.store, self.manifest, self.identity, self.shards = store, manifest, identity, shards

    def samples(self) -> int:
        return sum(shard["samples"] for shard in self.shards)

    def add(self, path: str, samples: int, state: dict[str, Any]) -> None:
        """Record a published shard and the Loader's state after its last sample."""
        self.shards.append(_shard(self.store, path, samples))
        _save(self.store, self.manifest, self.identity, self.shards, state)

    def complete(self) -> None:
        _save(self.store, self.manifest, self.identity, self.shards, None)


def _publish_shards(loader: Loader, pattern: str, record: _Record, bar: tqdm[Any]) -> None:
    """Publish, in order, the shards the workers wrote, each recorded in the manifest once whole."""
    store, position = record.store, record.samples()
    run = iter(loader)
    for built in run:
        if isinstance(built, ArgumentError):
            raise built
        path = pattern % len(record.shards)
        if isinstance(built, list):  # tar samples without keys: keyed here by position
            parts, index = tar_writer.shard_parts([_positioned(s, position + i) for i, s in enumerate(built)], path)
            with store.open_write(path) as out:
                sidecar = tar_writer.write_parts(parts, index, out)
            samples = len(built)
        else:
            data, sidecar, samples = built
            if isinstance(data, str):  # the worker's temporary file
                store.publish(data, path)
            else:
                with store.open_write(path) as out:
                    out.write(data)
        if sidecar is not None:
            with store.open_write(_tar_index.sidecar_url(path)) as out:
                out.write(sidecar)
        record.add(path, samples, make_state(loader.plan, run.position()))
        position += samples
        bar.update(samples)
    record.complete()


def _write_samples(
    loader: Loader,
    pattern: str,
    record: _Record,
    bar: tqdm[Any],
    format: str,
    maxcount: int | None,
    maxsize: int | None,
) -> None:
    """Write the samples as they come, in the main process: shard boundaries depend on sizes."""
    options = record.store.storage_options
    writer = WRITERS[format](pattern, maxcount, maxsize, storage_options=options, first_shard=len(record.shards))
    position = record.samples()
    in_shard = 0
    try:
        run = iter(loader)
        while True:
            before = run.position()
            try:
                sample = next(run)
            except StopIteration:
                break
            opened = len(writer.paths)
            writer.write(_positioned(_tar_safe(sample), position) if format == "tar" else sample)
            if len(writer.paths) > opened:  # this sample began a shard: the one before is finished
                if opened:
                    record.add(writer.paths[-2], in_shard, make_state(loader.plan, before))
                in_shard = 0
            in_shard += 1
            position += 1
            bar.update()
        writer.close()
        if in_shard:
            record.add(writer.paths[-1], in_shard, make_state(loader.plan, run.position()))
        record.complete()
    except BaseException:
        writer.abort()
        raise


def manifest_url(pattern: str) -> str:
    """Where `write_shards` records the shards of `pattern` it finished: beside them, the number
    field of the name replaced by `manifest`, plus `.json` (`out/shard-%06d.tar` ->
    `out/shard-manifest.tar.json`). ArgumentError when the name has no number field."""
    head, name = os.path.split(pattern) if not storage.scheme_of(pattern) else pattern.rsplit("/", 1)
    field = number_field(name)
    if field is None:
        raise ArgumentError(
            f"write_shards: pattern {pattern!r} needs a number field such as %06d in its file name "
            "(shards are numbered: out/shard-%06d.tar)"
        )
    name = name[: field.start()] + "manifest" + name[field.end() :] + ".json"
    return os.path.join(head, name) if not storage.scheme_of(pattern) else f"{head}/{name}"


def _tar_safe(sample: Any) -> Any:
    """The sample with its key made one TarWriter takes: dots in its last part turn to `_`, a
    leading `/` goes."""
    key = sample.get("__key__") if isinstance(sample, dict) else None
    if not isinstance(key, str):
        return sample  # TarWriter names what it needs; a missing key is numbered by `_positioned`
    head, _, last = key.lstrip("/").rpartition("/")
    return {**sample, "__key__": f"{head}/{last.replace('.', '_')}" if head else last.replace(".", "_")}


def _positioned(sample: Any, position: int) -> Any:
    """The sample keyed by its position in the chain (`%09d`) when it has no key."""
    if isinstance(sample, dict) and sample.get("__key__") is None:
        return {**sample, "__key__": f"{position:09d}"}
    return sample


def _length(dataset: Dataset) -> int | None:
    return dataset.plan.items_per_epoch()  # None: a stream, or a filter or flat_map changes the count


def _shard(store: storage.Store, path: str, samples: int) -> dict[str, Any]:
    return {"path": path, "samples": samples, "bytes": store.stat(path).size}


def _save(
    store: storage.Store,
    manifest: str,
    identity: dict[str, Any],
    shards: list[dict[str, Any]],
    state: dict[str, Any] | None,
) -> None:
    """Record the finished shards (published whole: a reader sees the old record or the new)."""
    record = {
        "format": _MANIFEST_FORMAT,
        "version": _MANIFEST_VERSION,
        **identity,
        "shards": shards,
        "complete": state is None,
        "state": state,
    }
    with store.open_write(manifest) as out:
        out.write(json.dumps(record, indent=1).encode())


def _finished(store: storage.Store, manifest: str, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of an earlier run of this very call, its shards checked to be there, or None
    when there is none; ArgumentError naming it when it is of another call, or its shards changed."""
    data = store.read_optional(manifest, _MANIFEST_MAX)
    if data is None:
        return None
    try:
        record = json.loads(data)
        if record.get("format") != _MANIFEST_FORMAT or record.get("version") != _MANIFEST_VERSION:
            raise ValueError(f"format {record.get('format')!r} version {record.get('version')!r}")
        shards = [(str(s["path"]), int(s["samples"]), int(s["bytes"])) for s in record["shards"]]
        complete = bool(record["complete"])
        if not complete and not isinstance(record["state"], dict):
            raise ValueError("no state to continue from")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArgumentError(
            f"{manifest} is not a manifest of write_shards ({exc}); delete it and its shards, or write elsewhere"
        ) from None
    differ = [name for name, value in identity.items() if record.get(name) != value]
    if differ:
        what = ", ".join(f"{name} {record.get(name)!r} there, {identity[name]!r} here" for name in differ)
        raise ArgumentError(
            f"{manifest} records shards written by another call ({what}); write to another pattern, "
            "or delete the manifest and its shards to start over"
        )
    for path, _, size in shards:
        try:
            found = store.stat(path).size
        except SourceError:
            found = None
        if found != size:
            state = "is missing" if found is None else f"has {found} bytes, not {size}"
            raise ArgumentError(
                f"{path} {state}, though {manifest} lists it as finished; delete the manifest and "
                "the shards to start over"
            )
    return dict(record)

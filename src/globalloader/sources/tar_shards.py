"""TarShards: WebDataset-style tar shards with random access through a cached member index."""

from __future__ import annotations

import bisect
import gzip
import os
import pathlib
import threading
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from globalloader import _paths, storage
from globalloader.errors import ArgumentError, SourceError, check_int
from globalloader.sources import _files, _tar_index
from globalloader.sources._files import CachedShardFiles, prefetch_files
from globalloader.sources._tar_format import split_key, walk
from globalloader.sources.base import check_index, fingerprint_of
from globalloader.storage._fork import ProcessLocal

_STREAM_BUFFER = 1024 * 1024
_GZIP_SUFFIXES = (".gz", ".tgz")
_LARGEST_READ = 256 << 20  # bytes asked of a stream at once
_READ_ALONE = 8  # samples of a remote shard read alone before it is read whole (see keep_blocks)
_REWRITTEN = "write the sidecar again (TarWriter) or delete it, then construct the source again"
REMOTE_INDEX_THREADS = 16  # sidecars of remote shards read at once (each a small request)


class TarShards(ProcessLocal, CachedShardFiles):
    """Records from tar shards in the WebDataset layout, addressable by global index.

    Members are grouped into samples as `webdataset` groups them: the key is the member path up
    to the first dot of its basename, the field name is the rest, lower-cased; consecutive
    members with the same key form one sample; `__x__` metadata members and names without an
    extension are skipped. A record is `{"__key__", "__url__", <ext>: bytes, ...}`, the same
    dict `webdataset.WebDataset(url)` yields without decoding.

    `urls`: a str with brace patterns (`shard-{000000..000127}.tar`, `{a,b}`) or globs, or a list
    of them; local paths or any fsspec URL. Each shard is indexed once by a header scan, on the
    first `len()` or `[i]` (or `build_index()`; `iter_records()` alone never needs it); the index
    is cached under `index_dir` (default: the globalloader cache folder) keyed by the shard's
    location, size and mtime/ETag, and reused by later constructions (`scanned` counts the
    shards this instance had to scan).

    Remote shards (`s3://`, `gs://`, ...; `storage_options=` go to fsspec) are downloaded whole,
    once per machine, into the machine-wide cache (`cache_limit=`, see `globalloader.storage`)
    and read from there by every worker, job and epoch. A remote shard's index comes from its
    sidecar `<shard>.idx` (TarWriter writes one) with one small request, so planning downloads
    no shard; a sidecar that is missing, stale (the shard's size or MD5 ETag differ) or corrupt
    is passed over (with a warning unless missing) and the shard is scanned, from the cached
    file: no extra download. The shard's CRC-32 in the sidecar is compared with the downloaded
    bytes before its first sample is read (a mismatch is a SourceError). `prefetch(shards)`
    downloads shards ahead in the background. `cache=False` reads them by ranged requests
    instead (one per sample). A sidecar matched by a pattern beside its shard is not a shard.

    Shuffling: `shuffle(seed, window=w)` permutes the shards, then the samples within windows of
    `w` shards (`block_starts`: each shard's first sample). Shards of a URL the cache does not
    hold (`memory://`, `cache=False`) are then read whole after their first few samples and each
    worker process keeps `2 * w` of them in memory (`keep_blocks`).

    Errors: a missing shard raises SourceError at construction; a truncated or corrupt tar (cut
    short, or a member that does not end where the next header begins; see `_tar_format`)
    raises SourceError naming the byte offset when indexed or streamed, and no index of it is
    kept; an index outside [0, len) raises SampleIndexError.
    Thread-safe for reads; safe to pickle to, or fork into, worker processes. The index lives in
    memory (about 16 bytes per sample plus 24 per member) and travels with a pickled source.
    """

    def __init__(
        self,
        urls: Any,
        *,
        index_dir: str | os.PathLike[str] | None = None,
        threads: int = 8,
        max_open: int = 256,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
        cache: bool = True,
    ) -> None:
        threads, max_open = check_int(threads, "threads", 1), check_int(max_open, "max_open")
        if index_dir is not None and not isinstance(index_dir, (str, os.PathLike)):
            raise ArgumentError(f"index_dir must be a str, a path or None, got {index_dir!r}")
        self.store = storage.Store(storage_options, cache_limit, cache=cache)
        self.shards: list[str] = _without_sidecars(_files.expand_urls(urls, "urls", self.store))
        self._index_dir = index_dir
        self._threads = min(threads, len(self.shards))
        self._reader = storage.RangeReader(self.store, max_open, whole=True)
        self._remote = [bool(storage.scheme_of(url)) for url in self.shards]
        # Shards held in the machine cache are read whole from it, never kept in memory.
        self._cached = [self.store.cached(url) for url in self.shards]
        self._stats = self.store.stats(self.shards, self._threads)  # a listing answered them: no request
        for url, st in zip(self.shards, self._stats, strict=True):
            self._reader.expect(url, st)
        versions = (f"{u}\t{s.size}\t{s.version}" for u, s in zip(self.shards, self._stats, strict=True))
        self.fingerprint: str = fingerprint_of("TarShards", versions)
        self.scanned = 0  # shards whose index had to be built by a scan (not read from cache)
        self.sidecars = 0  # shards whose index came from their sidecar
        self._crcs: list[int | None] = [None] * len(self.shards)  # CRC-32 a sidecar gave, checked on read
        self.kept_shards = 0  # remote shards kept whole per process (see keep_blocks)
        self._len = 0
        self._indexed = False
        self._reset()

    _PROCESS_ONLY = ("_lock", "_crc_checked", "_whole", "_touched")

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._crc_checked: set[int] = set()  # shards whose CRC this process compared
        self._whole: OrderedDict[int, bytes] = OrderedDict()  # remote shards read whole, LRU
        self._touched: OrderedDict[int, int] = OrderedDict()  # samples read ranged per recent shard, LRU

    @property
    def block_starts(self) -> np.ndarray:
        """Each shard's first sample: the blocks `shuffle(window=...)` permutes."""
        if not self._indexed:
            self.build_index()
        return np.array(self._shard_start[:-1], dtype=np.int64)

    def keep_blocks(self, count: int) -> None:
        """Keep up to `count` remote shards whole in memory, per process: a windowed shuffle reads
        its window's shards in random order, so a shard is read whole once a few of its samples
        were read while it was among the recently read shards, instead of one request per sample.
        Local and machine-cached shards are read sample by sample."""
        self.kept_shards = max(self.kept_shards, int(count))

    def build_index(self) -> None:
        """Load or build every shard's index (done on first `len()` or `[i]`; idempotent)."""
        with self._lock:
            if self._indexed:
                return
            wanted = pathlib.Path(
                _paths.cache_dir("tar-index", create=False) if self._index_dir is None else self._index_dir
            )
            folder: pathlib.Path | None = wanted
            try:
                _paths.make_folder(wanted)  # made as the cache folders are: private unless shared
            except OSError:  # a read-only cache costs a scan per construction, not a failure
                folder = None
            indexes = []
            bar = tqdm(
                total=len(self.shards), desc="indexing tar shards", unit="shard", delay=2.0, disable=None, leave=False
            )
            with ThreadPoolExecutor(self._index_threads()) as pool, bar:
                for index, how in pool.map(lambda i: self._index_one(i, folder), range(len(self.shards))):
                    indexes.append(index)
                    self.scanned += how == "scan"
                    self.sidecars += how == "sidecar"
                    bar.update()
            self._combine(indexes)
            self._indexed = True

    def _index_threads(self) -> int:
        """Threads for indexing: `threads`, or up to REMOTE_INDEX_THREADS when shards are remote,
        since reading a sidecar waits on the network, not on this machine."""
        return min(len(self.shards), max(self._threads, REMOTE_INDEX_THREADS if any(self._cached) else 1))

    def _index_one(self, i: int, folder: pathlib.Path | None) -> tuple[_tar_index.ShardIndex, str]:
        """Shard `i`'s index, and where it came from: "cache", "sidecar" or "scan"."""
        url, st = self.shards[i], self._stats[i]
        path = _tar_index.index_path(folder, url, st) if folder is not None else None
        index = _tar_index.load(path) if path is not None else None
        if index is not None:
            return index, "cache"
        if self._remote[i]:
            sidecar = self._sidecar(i)
            if sidecar is not None and sidecar.shard_index is not None:
                if path is not None and sidecar.verified:  # else checked by CRC each time: not kept
                    _tar_index.save(path, sidecar.shard_index)
                return sidecar.shard_index, "sidecar"
        # A cached shard is downloaded whole by its first read, so the scan reads local bytes.
        remote = self._remote[i] and not self._cached[i]
        index = _tar_index.scan(lambda start, n: self._reader.read(url, start, n), url, st.size, remote)
        if path is not None:
            _tar_index.save(path, index)
        return index, "scan"

    def _sidecar(self, i: int) -> _tar_index.Sidecar | None:
        """Shard `i`'s sidecar, if it exists and can be trusted (a refused one is a warning).
        Its CRC can be checked only against a shard cached whole, else its ETag must prove it:
        when neither can, the sidecar is not even asked for."""
        url, st = self.shards[i], self._stats[i]
        checkable = self._cached[i] and st.size <= self.store.whole_max
        if not (checkable or _tar_index.proves_content(st)):
            return None
        name = _tar_index.sidecar_url(url)
        try:
            data = self.store.read_optional(name, _tar_index.SIDECAR_MAX)
        except SourceError as exc:
            warnings.warn(f"index sidecar {name} not read, the shard is scanned instead: {exc}", stacklevel=2)
            return None
        if data is None:
            return None
        sidecar = _tar_index.read_sidecar(data, url, st)
        if sidecar.shard_index is None:
            warnings.warn(f"{sidecar.problem}; the shard is scanned instead", stacklevel=2)
            return None
        return sidecar if sidecar.verified or checkable else None

    def _combine(self, indexes: list[_tar_index.ShardIndex]) -> None:
        """Join the shard indexes into global arrays, so a lookup is two slices and a bisect."""
        exts: dict[str, int] = {}
        member_starts, key_starts, members = [], [], []
        n_members = n_keys = 0
        self._shard_start = [0]
        self._crcs = [index.crc32 for index in indexes]
        for url, st, crc in zip(self.shards, self._stats, self._crcs, strict=True):
            if crc is not None:  # downloads of the shard are checked against it, and fetched again on a mismatch
                sidecar = f"its index sidecar {_tar_index.sidecar_url(url)}"
                self.store.expect_crc32(url, st, crc, sidecar, _REWRITTEN)
        for index in indexes:
            remap = np.array([exts.setdefault(e, len(exts)) for e in index.exts] or [0], np.int64)
            shard_members = index.members.copy()
            shard_members[:, 2] = remap[shard_members[:, 2]]
            members.append(shard_members)
            member_starts.append(index.member_start[:-1] + n_members)
            key_starts.append(index.key_start[:-1] + n_keys)
            n_members += len(index.members)
            n_keys += len(index.keys)
            self._shard_start.append(self._shard_start[-1] + len(index))
        # Row i holds sample i's first member and key position; row i + 1 ends them.
        self._starts = np.stack(
            [np.concatenate([*member_starts, [n_members]]), np.concatenate([*key_starts, [n_keys]])], axis=1
        ).astype(np.int64)
        self._members = np.concatenate(members) if members else np.zeros((0, 3), np.int64)
        self._keys = b"".join(index.keys for index in indexes)
        self._exts = list(exts)
        self._len = self._shard_start[-1]

    def __len__(self) -> int:
        if not self._indexed:
            self.build_index()
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            if not self._indexed:
                self.build_index()
            index = check_index(index, self._len, self)
        shard = bisect.bisect_right(self._shard_start, index) - 1
        url = self.shards[shard]
        (m0, k0), (m1, k1) = self._starts[index : index + 2].tolist()
        record: dict[str, Any] = {"__key__": self._keys[k0:k1].decode("utf-8", "surrogateescape"), "__url__": url}
        exts = self._exts
        members = self._members[m0:m1].tolist()
        if not self._remote[shard] or self._cached[shard]:
            if self._crcs[shard] is not None and shard not in self._crc_checked:
                self._check_crc(shard)
            read = self._reader.read_local if not self._remote[shard] else self._reader.read_remote
            for offset, size, ext in members:
                data = read(url, offset, size)
                if len(data) != size:
                    raise _changed(url, offset)
                record[exts[ext]] = data
            return record
        # Remote: one request for the whole sample (its members are adjacent), or the whole
        # shard when shards are kept; then slices.
        start = members[0][0] if members else 0
        end = max((o + s for o, s, _ in members), default=start)
        whole = self._whole_shard(shard) if self.kept_shards else None
        if whole is not None:
            blob, start = whole, 0  # offsets then count from the shard's start
        else:
            blob = self._reader.read_remote(url, start, end - start)
            if len(blob) != end - start:
                raise _changed(url, start)
        for offset, size, ext in members:
            record[exts[ext]] = blob[offset - start : offset - start + size]
        return record

    def _check_crc(self, shard: int) -> None:
        """Compare the shard as downloaded with the CRC-32 its sidecar gave (once per process)."""
        url, expected = self.shards[shard], self._crcs[shard]
        found = self._reader.crc32(url)
        if found is not None and found != expected:
            raise SourceError(
                f"{url} does not match its index sidecar {_tar_index.sidecar_url(url)} (CRC-32 {found:#010x}, "
                f"the sidecar says {expected:#010x}): the shard was rewritten without its sidecar; {_REWRITTEN}"
            )
        self._crc_checked.add(shard)

    def _whole_shard(self, shard: int) -> bytes | None:
        """Shard `shard` whole, if kept or now worth reading whole; None: read the sample alone.
        Worth it after `min(8, samples / 4)` samples of it were read alone while it stayed among
        the `4 * kept_shards` most recently read shards."""
        with self._lock:
            blob = self._whole.get(shard)
            if blob is not None:
                self._whole.move_to_end(shard)
                return blob
            read = self._touched.pop(shard, 0)
            samples = self._shard_start[shard + 1] - self._shard_start[shard]
            if read < min(_READ_ALONE, max(1, samples // 4)):
                self._touched[shard] = read + 1
                while len(self._touched) > 4 * self.kept_shards:
                    self._touched.popitem(last=False)
                return None
        url, size = self.shards[shard], self._stats[shard].size
        blob = self._reader.read_remote(url, 0, size)
        if len(blob) != size:
            raise _changed(url, len(blob))
        with self._lock:
            self._whole[shard] = blob
            while len(self._whole) > self.kept_shards:
                self._whole.popitem(last=False)
        return blob

    def iter_records(self, shards: Any = None) -> Iterator[dict[str, Any]]:
        """Yield the records of all shards (or of the shard indices in `shards`) in file order.

        Streams each shard sequentially without using the index, so it also reads gzip-compressed
        tars. Samples never span shards. A plain generator: to resume, restart at a shard.
        """
        chosen = range(len(self.shards)) if shards is None else shards
        for i in chosen:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.shards):
                raise ArgumentError(f"shards must hold indices in 0..{len(self.shards) - 1}, got {i!r}")
            yield from _stream_shard(self.store, self.shards[i], self._stats[i] if self._remote[i] else None)

    @property
    def streamed(self) -> bool:
        """Whether some shard is gzip-compressed (`.tar.gz`, `.tgz`): no index, so the shards are
        read in order by `iter_records` only (`StreamedShards`)."""
        return any(url.lower().endswith(_GZIP_SUFFIXES) for url in self.shards)

    @property
    def remote(self) -> bool:
        """Whether any shard is read through the machine cache (so `prefetch` has work to do)."""
        return any(self._cached)

    def prefetch(self, indices: Any) -> None:
        """Download the shards of these sample indices into the machine cache in the background,
        a few at a time, in the order they are first named (cached shards cost no request)."""
        if not self.remote:
            return
        if not self._indexed:
            self.build_index()
        prefetch_files(self.store, self._shard_start, indices, self.shards, self._stats, self._cached)

    def close(self) -> None:
        """Close this process's open shard files (later reads reopen them)."""
        self._reader.close()

    def __repr__(self) -> str:
        size = f"{self._len} samples" if self._indexed else "not indexed yet"
        return f"TarShards({len(self.shards)} shards, {size})"


def _without_sidecars(urls: list[str]) -> list[str]:
    """The shards among `urls`: a sidecar listed beside its shard (a pattern such as `shard-*`
    matches both) is left out."""
    listed = set(urls)
    suffix = _tar_index.SIDECAR_SUFFIX
    return [u for u in urls if not (u.endswith(suffix) and u[: -len(suffix)] in listed)]


def _changed(url: str, offset: int) -> SourceError:
    return SourceError(
        f"{url} is shorter than its index says at offset {offset}: the file "
        "changed after it was indexed; construct the source again"
    )


def _stream_shard(store: storage.Store, url: str, stat: storage.FileStat | None) -> Iterator[dict[str, Any]]:
    """A shard's records in file order, read as a stream (plain or gzip). A gzip shard is read to
    its end, so that its CRC and length are checked: a damaged one is a `SourceError` naming it."""
    with storage.open_read(store, url, stat) as raw:
        packed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        if not packed:
            yield from _records(raw, url)
            return
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield from _records(stream, url)  # type: ignore[arg-type]  # read to the end: CRC checked
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise SourceError(f"cannot read gzip tar shard {url}: {exc}") from exc


def _records(stream: IO[bytes], url: str) -> Iterator[dict[str, Any]]:
    reader = _ForwardReader(stream, url)
    sample: dict[str, Any] | None = None
    for member in walk(reader.read_at, url, None):
        split = split_key(member.name)
        if split is None:
            continue
        key, ext = split
        if sample is None or key != sample["__key__"]:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        elif ext in sample:
            raise SourceError(
                f"duplicate member {member.name!r} in {url} at offset "
                f"{member.offset}: sample {key!r} already has a .{ext} field"
            )
        data = reader.read_at(member.offset, member.size)
        if len(data) != member.size:
            raise SourceError(
                f"truncated tar {url}: member {member.name!r} at offset "
                f"{member.offset - 512} needs {member.size} bytes, "
                f"got {len(data)}"
            )
        sample[ext] = data
    if sample is not None:
        yield sample


class _ForwardReader:
    """`read_at` over a buffered stream (its reads are short only at its end): moves forward by
    reading and dropping, and keeps its last read, from which `walk` reads the tail of a member's
    data again after the caller read that data."""

    def __init__(self, stream: IO[bytes], url: str) -> None:
        self._stream, self._url, self._pos = stream, url, 0
        self._last, self._last_at = b"", 0  # the bytes of the last read, and where they started

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < self._pos:
            assert offset >= self._last_at, "walk reads again only within the last read"
            kept = self._last[offset - self._last_at : offset - self._last_at + length]
            return kept + self._read(length - len(kept))
        if offset != self._pos:
            self._skip(offset)
        return self._read(length)

    def _read(self, length: int) -> bytes:
        # By pieces: a damaged size field may ask for more than memory holds, or than read() takes.
        pieces = []
        while length > 0 and (piece := self._stream.read(min(length, _LARGEST_READ))):
            pieces.append(piece)
            length -= len(piece)
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._last, self._last_at = data, self._pos
        self._pos += len(data)
        return data

    def _skip(self, offset: int) -> None:
        while self._pos < offset:
            if not self._read(min(offset - self._pos, _STREAM_BUFFER)):
                raise SourceError(
                    f"truncated tar {self._url}: the file ends at byte {self._pos}, before offset {offset}"
                )

"""The one I/O layer: paths and URLs -> bytes and ranges, the machine-wide cache, retries,
prefetch, atomic writes (`write_atomic`, from the ground floor's `_paths`, where its lowest user is).

Nothing else in globalloader opens a file or a URL: local paths are read here too (`local`: whole
files, pyarrow's own files, memory maps; `RangeReader`: ranges), so local and remote reads cannot
drift apart. Sources hold a `Store` (their `storage_options=` and `cache_limit=`) and read through
it; see docs/remote.md.
"""

from globalloader._paths import write_atomic
from globalloader.storage._fork import reset_in_forked_children
from globalloader.storage._fs import import_clients, scheme_of
from globalloader.storage.cache import ObjectCache, parse_size
from globalloader.storage.local import memory_map, read_whole
from globalloader.storage.ranges import RangeFile, RangeReader, open_arrow, open_read
from globalloader.storage.retry import RetryPolicy
from globalloader.storage.store import FileStat, StagedWrite, Store, cache_key, stale_temporaries

__all__ = [
    "FileStat",
    "ObjectCache",
    "RangeFile",
    "RangeReader",
    "RetryPolicy",
    "StagedWrite",
    "Store",
    "cache_key",
    "import_clients",
    "memory_map",
    "open_arrow",
    "open_read",
    "parse_size",
    "read_whole",
    "reset_in_forked_children",
    "scheme_of",
    "stale_temporaries",
    "write_atomic",
]

"""The one I/O layer: URL -> bytes and ranges, the machine-wide cache, retries, prefetch, atomic
writes (`write_atomic`, from the ground floor's `_paths`).

Nothing else in globalloader opens a URL. Sources hold a `Store` (their `storage_options=` and
`cache_limit=`) and read through it; see docs/remote.md.
"""

from globalloader._paths import write_atomic
from globalloader.storage._fork import reset_in_forked_children
from globalloader.storage._fs import scheme_of
from globalloader.storage.cache import ObjectCache, parse_size
from globalloader.storage.ranges import RangeFile, RangeReader, open_read
from globalloader.storage.retry import RetryPolicy
from globalloader.storage.store import FileStat, Store, cache_key

__all__ = [
    "FileStat",
    "ObjectCache",
    "RangeFile",
    "RangeReader",
    "RetryPolicy",
    "Store",
    "cache_key",
    "open_read",
    "parse_size",
    "reset_in_forked_children",
    "scheme_of",
    "write_atomic",
]

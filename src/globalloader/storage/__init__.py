"""The one I/O layer: URL -> bytes and ranges, the machine-wide cache, retries, prefetch.

Nothing else in globalloader opens a URL. Sources hold a `Store` (their `storage_options=` and
`cache_limit=`) and read through it; see docs/remote.md.
"""

from globalloader.storage._fork import reset_in_forked_children
from globalloader.storage._fs import scheme_of
from globalloader.storage.cache import ObjectCache, parse_size
from globalloader.storage.ranges import RangeFile, RangeReader, open_read
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
    "open_read",
    "parse_size",
    "reset_in_forked_children",
    "scheme_of",
    "stale_temporaries",
]

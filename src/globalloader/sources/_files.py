"""Turning a sources' `urls`/`paths` argument into a list of URLs: braces first, then globs.

Braces follow bash's rules, the WebDataset convention (`shard-{000000..000127}.tar`,
`{train,val}`), by the `braceexpand` library; an unbalanced brace or a step of 0 is an
ArgumentError, never a literal or a guess: in a shard pattern it is almost always a typo.
Listing a remote folder is I/O, so globs go through the source's `storage.Store`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
from braceexpand import braceexpand

from globalloader.errors import ArgumentError, SourceError
from globalloader.storage import FileStat, Store

_GLOB_CHARS = frozenset("*?[")
_ZERO_STEP = re.compile(r"\{[^{}]*\.\.[^{}]*\.\.-?0+\}")


def expand_braces(pattern: str) -> list[str]:
    """Every string `pattern` expands to, in order (a pattern without braces: itself)."""
    if not isinstance(pattern, str):
        raise ArgumentError(f"brace pattern must be a str, got {type(pattern).__name__}")
    if _ZERO_STEP.search(pattern):
        raise ArgumentError(f"brace range with step 0 in {pattern!r}")
    try:
        return list(braceexpand(pattern))
    except ValueError:  # braceexpand's UnbalancedBracesError
        raise ArgumentError(f"unbalanced brace in {pattern!r}") from None


def expand_urls(urls: Any, argument: str, store: Store | None = None) -> list[str]:
    """Turn a str, path or list of them into a list of URLs: braces first, then globs.

    A pattern with glob characters that matches nothing is a SourceError naming it; an empty
    result or a wrong type is an ArgumentError naming `argument`.
    """
    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]
    elif not isinstance(urls, Iterable) or isinstance(urls, (bytes, dict)):
        raise ArgumentError(f"{argument} must be a str, a path or a list of them, got {type(urls).__name__}")
    store = store if store is not None else Store()
    expanded: list[str] = []
    for item in urls:
        if not isinstance(item, (str, os.PathLike)):
            raise ArgumentError(f"{argument} items must be str or paths, got {type(item).__name__}")
        for url in expand_braces(os.fspath(item)):
            if _GLOB_CHARS.isdisjoint(url) or os.path.exists(url):
                expanded.append(url)
                continue
            matches = store.glob(url)
            if not matches:
                raise SourceError(f"no file matches {url!r}")
            expanded.extend(matches)
    if not expanded:
        raise ArgumentError(f"{argument} is empty")
    return expanded


class CachedShardFiles:
    """`CachedBlocks` for a source whose blocks are its files (`_stats`, `_cached`, `store`):
    TarShards, MDS and LitData."""

    _stats: list[FileStat]
    _cached: list[bool]
    store: Store

    def cached_block_bytes(self) -> np.ndarray:
        """Each block's (file's) bytes in the machine cache, 0 for one read without it
        (`shuffle(window=...)` checks a window fits it)."""
        held = zip(self._stats, self._cached, strict=True)
        return np.array([st.size if cached else 0 for st, cached in held], dtype=np.int64)

    def keep_cached(self, size: int) -> int:
        """Let the readers keep `size` bytes of shards open (`Store.keep_open`); the cache's room."""
        return self.store.keep_open(size)


def prefetch_files(
    store: Store, starts: Any, indices: Any, files: list[str], stats: list[FileStat], cached: list[bool]
) -> None:
    """Download into the machine cache, in the background, the files holding these record
    indices (file `i` holds the records from `starts[i]` on), in the order first named; files
    not read through the cache cost nothing."""
    held = np.searchsorted(starts, np.asarray(indices, dtype=np.int64), side="right") - 1
    wanted = [i for i in dict.fromkeys(held.tolist()) if 0 <= i < len(files) and cached[i]]
    store.prefetch([(files[i], stats[i]) for i in wanted])

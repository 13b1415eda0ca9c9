"""Where globalloader keeps files it makes for itself (tar indexes, demo data, disk caches)."""

from __future__ import annotations

import os
import pathlib


def cache_dir(*parts: str, create: bool = True) -> pathlib.Path:
    """Return the cache folder joined with `parts`, creating it on demand (unless `create` is false).

    The base is `$GLOBALLOADER_CACHE_DIR` if set, else `$XDG_CACHE_HOME/globalloader`, else
    `~/.cache/globalloader`. Read on every call, so a test or a job can redirect it with the
    environment variable alone.
    """
    base = os.environ.get("GLOBALLOADER_CACHE_DIR")
    if base:
        root = pathlib.Path(base).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
        root = root / "globalloader"
    path = root.joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path

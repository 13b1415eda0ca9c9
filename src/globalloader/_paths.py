"""Where globalloader keeps files it makes for itself (tar indexes, demo data, disk caches)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

from globalloader.errors import StorageError


def cache_dir(*parts: str, create: bool = True) -> pathlib.Path:
    """Return the cache folder joined with `parts`, creating it on demand (unless `create` is false).

    The base is `$GLOBALLOADER_CACHE_DIR` if set, else `$XDG_CACHE_HOME/globalloader`, else
    `~/.cache/globalloader`. Read on every call, so a test or a job can redirect it with the
    environment variable alone.
    """
    base, xdg = os.environ.get("GLOBALLOADER_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME")
    if base:
        root, chosen_by = pathlib.Path(base).expanduser(), f"GLOBALLOADER_CACHE_DIR={base}"
    elif xdg:
        root, chosen_by = pathlib.Path(xdg).expanduser() / "globalloader", f"XDG_CACHE_HOME={xdg}"
    else:
        root, chosen_by = pathlib.Path.home() / ".cache" / "globalloader", "the home folder"
    path = root.joinpath(*parts)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create the cache folder {path} (from {chosen_by}): {exc.strerror}; "
                "point GLOBALLOADER_CACHE_DIR at a writable folder"
            ) from None
    return path


def build_once(
    root: pathlib.Path, name: str, params: dict[str, Any], whole: Callable[[], bool], build: Callable[[], None]
) -> None:
    """Run `build` in `root` unless an earlier build with the same `params` is complete there.

    A marker `root/.globalloader-{name}.json`, written last, records the parameters; `whole()`
    says the files are all there. Different parameters, or files left by an interrupted build,
    are built again. A lock file serialises concurrent callers (several ranks starting together).
    """
    marker = root / f".globalloader-{name}.json"

    def complete() -> bool:
        try:
            return bool(json.loads(marker.read_text()) == params) and whole()
        except (OSError, ValueError):
            return False

    if complete():
        return
    import fcntl  # POSIX only; imported here so the rest of the module works everywhere

    with open(root / f".globalloader-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if complete():  # another process finished while this one waited
            return
        marker.unlink(missing_ok=True)
        build()
        temporary = marker.with_suffix(".tmp")
        temporary.write_text(json.dumps(params))
        os.replace(temporary, marker)

"""Where globalloader keeps files it makes for itself (tar indexes, demo data, disk caches), and
who may have written them.

What these folders hold decides what a job reads (a tar index, a downloaded object), so they
must be writable by this user alone: a folder, or a file in it, that another user owns or could
write is refused (StorageError naming it and the fix), never read. The user may opt into a cache
shared with the folder's group (`GLOBALLOADER_CACHE_SHARED=group`): then the folder and its
files may belong to other members of a group of this user's, never be writable by every user,
and the object cache checks entries another user wrote at every open (see `storage.cache`).
Files are opened without following symbolic links (a link planted in the folder would redirect
a write), folders are checked with `lstat`.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import stat
from collections.abc import Callable
from typing import Any

from globalloader.errors import ArgumentError, StorageError

SHARED_ENV = "GLOBALLOADER_CACHE_SHARED"


def shared_with_group() -> bool:
    """Whether the user opted into cache folders shared with their group (read per call)."""
    value = os.environ.get(SHARED_ENV, "")
    if value not in ("", "group"):
        raise ArgumentError(
            f"{SHARED_ENV} must be 'group' (a cache shared with its folder's group) or unset, got {value!r}"
        )
    return value == "group"


def folder_mode() -> int:
    """Mode of the folders globalloader makes: this user's alone, or its group's (setgid, so
    every member's files get the folder's group)."""
    return 0o2770 if shared_with_group() else 0o700


def file_mode(group_writes: bool = False) -> int:
    """Mode of the files globalloader makes: readable by the group when shared, and writable by
    it only where every member updates the file in place (`group_writes`: the cache's counters)."""
    if not shared_with_group():
        return 0o600
    return 0o660 if group_writes else 0o640


def cache_dir(*parts: str, create: bool = True) -> pathlib.Path:
    """Return the cache folder joined with `parts`, creating it on demand (unless `create` is false).

    The base is `$GLOBALLOADER_CACHE_DIR` if set, else `$XDG_CACHE_HOME/globalloader`, else
    `~/.cache/globalloader`. Read on every call, so a test or a job can redirect it with the
    environment variable alone. The base and the folders of `parts` that exist must pass
    `check_folder`.
    """
    base, xdg = os.environ.get("GLOBALLOADER_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME")
    if base:
        root, chosen_by = pathlib.Path(base).expanduser(), f"GLOBALLOADER_CACHE_DIR={base}"
    elif xdg:
        root, chosen_by = pathlib.Path(xdg).expanduser() / "globalloader", f"XDG_CACHE_HOME={xdg}"
    else:
        root, chosen_by = pathlib.Path.home() / ".cache" / "globalloader", "the home folder"
    path = root.joinpath(*parts)
    folders = [root.joinpath(*parts[:depth]) for depth in range(len(parts) + 1)]
    if create:
        try:
            for folder in folders:
                make_folder(folder)
        except OSError as exc:
            raise StorageError(
                f"cannot create the cache folder {path} (from {chosen_by}): {exc.strerror}; "
                "point GLOBALLOADER_CACHE_DIR at a writable folder"
            ) from None
    for folder in folders:
        # Without `create`, a missing folder or a file in its place is the caller's to make or fail on.
        if create or (os.path.lexists(folder) and not os.path.isfile(folder)):
            check_folder(folder, follow=folder == root)
    return path


def make_folder(path: pathlib.Path) -> None:
    """Create folder `path`, and its missing parents, with `folder_mode()` unless they exist;
    check it with `check_folder` before use."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=folder_mode())
        except FileExistsError:
            continue
        os.chmod(folder, folder_mode())  # exactly: the umask may have taken the group's bits


def check_folder(path: pathlib.Path, follow: bool = False) -> None:
    """Refuse (StorageError) folder `path` unless only this user (or, when shared, its group)
    can have written it. A symbolic link is refused, except with `follow` (the folder the user
    named) one this user or root made: then the folder it points to is checked."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and follow and st.st_uid in (os.geteuid(), 0):
        st = os.stat(path)
    why = untrusted(st)
    if why:
        raise _refusal(path, why, "folder")
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"the cache folder {path} is not a folder; point GLOBALLOADER_CACHE_DIR at a folder")


def untrusted(st: os.stat_result) -> str | None:
    """Why another user could have written the file or folder `st` describes (from lstat or
    fstat), or None when only this user (or, when shared, a member of its group) could."""
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not shared_with_group():
        if st.st_uid != uid:
            return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
        if mode & 0o022:
            return f"is writable by other users (mode {mode:o})"
        return None
    if mode & 0o002:
        return f"is writable by every user (mode {mode:o})"
    ours = {os.getegid(), *os.getgroups()}
    if st.st_gid not in ours and (st.st_uid != uid or mode & 0o020):
        return f"belongs to uid {st.st_uid} and group {st.st_gid}, not to this user (uid {uid}) or one of its groups"
    return None


def open_file(path: os.PathLike[str] | str, flags: int, create_mode: int | None = None) -> tuple[int, os.stat_result]:
    """Open a file of a cache folder and its `fstat`: never through a symbolic link, and refused
    (StorageError) when another user could have written it. With `create_mode`, a missing file is
    made with exactly that mode; else FileNotFoundError. Other OSErrors pass to the caller."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if create_mode is None:
                raise
            try:
                fd = create_file(path, flags, create_mode)
            except FileExistsError:  # another process made it meanwhile
                fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refusal(path, "is a symbolic link", "file") from None
        raise
    st = os.fstat(fd)
    why = untrusted(st)
    if why:
        os.close(fd)
        raise _refusal(path, why, "file")
    return fd, st


def create_file(path: os.PathLike[str] | str, flags: int, mode: int) -> int:
    """Make file `path` with exactly `mode` and open it; FileExistsError if any file or link has
    that name (O_EXCL: never written through a link)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    os.fchmod(fd, mode)  # exactly: the umask may have taken the group's bits
    return fd


def _refusal(path: os.PathLike[str] | str, why: str, kind: str) -> StorageError:
    """The error that refuses a cache `kind` ("file" or "folder") another user could have written."""
    if shared_with_group():
        fix = (
            f"a cache shared with a group must belong to one of your groups and be writable by it and not by "
            f"every user (chgrp, chmod 2770 for folders, 640 for files); or unset {SHARED_ENV} and use a folder "
            "of your own"
        )
    else:
        fix = (
            "point GLOBALLOADER_CACHE_DIR at a folder of your own (only you can write it)"
            + (", or remove the file (the cache makes it again)" if kind == "file" else "")
            + f", or set {SHARED_ENV}=group for a cache shared with your group"
        )
    return StorageError(f"refusing the cache {kind} {path}: it {why}, so another user could decide what is read; {fix}")


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

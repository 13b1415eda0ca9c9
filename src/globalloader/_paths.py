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

Every file globalloader writes whole is written by `write_atomic` (a temporary file renamed into
place): it lives here, on the ground floor, because its lowest user is `build_once` below and
because its temporary file is made like the cache's files (`create_file`: O_EXCL, no link, an
exact mode); `storage` re-exports it for the floors above.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import random
import re
import socket
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

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
        with write_atomic(marker) as out:  # not durable: a marker lost to a crash only costs a rebuild
            out.write(json.dumps(params).encode())


def host_tag() -> str:
    """This machine's name with letters and digits only: one field of a file name."""
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())


_HOST = host_tag()  # with the pid, names whose temporary files they are (see `temporary_writer`)
_NAME_MAX = 255  # bytes of one file name on Linux file systems
_TOKEN = 4  # random bytes in a temporary file's name
# Their source: no system call per file (os.urandom's), and not `random`'s own generator, whose
# state is the user's (a seeded job's sequence, a resume's saved state); reseeded in a forked child.
_TOKENS = random.Random()
# Each thread's "host-pid-tid", made once per thread: getpid and gettid are system calls.
_WRITER = threading.local()


def _after_fork_in_child() -> None:
    global _WRITER
    _TOKENS.seed()
    _WRITER = threading.local()  # the forking thread's holds the parent's pid


os.register_at_fork(after_in_child=_after_fork_in_child)


class AtomicWrite:
    """A file being written by `write_atomic`: `write`, or hand `file` to a writer that takes a
    file object; `temporary` is where the bytes are until `commit` renames them into place."""

    def __init__(self, path: pathlib.Path, temporary: pathlib.Path, file: IO[bytes], durable: bool) -> None:
        self.path, self.temporary, self.file, self.durable = path, temporary, file, durable
        self.committed = False

    def write(self, data: bytes | memoryview) -> int:
        return self.file.write(data)

    def sync(self) -> None:
        """Flush the bytes written so far and wait until they are on disk (what `commit` does
        first when durable: called earlier, the wait stays out of a lock the rename needs, and
        the commit's own sync finds nothing left to write)."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def commit(self) -> None:
        """Publish the bytes under `path` now (else `write_atomic` does when its block ends):
        flushed, synced to disk first when durable, then renamed over whatever was there."""
        if self.durable:
            self.sync()  # the rename must never publish data still in flight
        self.file.close()
        os.replace(self.temporary, self.path)
        self.committed = True


@contextlib.contextmanager
def write_atomic(
    path: os.PathLike[str] | str, *, durable: bool = False, mode: int | None = None, buffering: int = -1
) -> Iterator[AtomicWrite]:
    """Write the file `path` whole or not at all: the block writes a temporary file beside it,
    renamed over `path` when the block ends (or at `AtomicWrite.commit`).

    A failure or exception in the block removes the temporary file and leaves `path` as it was; a
    process killed mid-write leaves only a temporary file (`temporary_writer` names its writer,
    so a cleaner can tell a dead one's), never half a file under `path`. Concurrent writers of
    one path each publish a whole file; the last rename wins. The temporary name is unique per
    process and thread (host, pid, thread id and a random token), made with O_EXCL in the same
    folder, never through a symbolic link. `durable`: the data is synced to disk before the
    rename, for files a crash of the machine must not leave empty or cut short under their name
    (the Arrow copy, the report: they are trusted once named); the others are
    checked when read or made again (the object cache: its CRCs). A crash may still lose the rename itself: then the old
    file, or none, is there, never a part of the new one. `mode`: exactly this mode (the cache's
    rules, `file_mode`), else the umask's default. The file is opened for reading too (a writer
    may check what it wrote). OSErrors pass.
    """
    target = pathlib.Path(path)
    temporary = pathlib.Path(_temporary_for(target))
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = create_file(temporary, os.O_RDWR, mode) if mode is not None else os.open(temporary, flags, 0o666)
    # Closed by `commit`, or below without raising over the block's own exception.
    write = AtomicWrite(target, temporary, open(fd, "r+b", buffering=buffering), durable)  # noqa: SIM115
    try:
        yield write
        if not write.committed:
            write.commit()
    except BaseException:
        with contextlib.suppress(OSError):  # a flush the disk refuses: the temporary goes anyway
            write.file.close()
        if not write.committed:
            temporary.unlink(missing_ok=True)
        raise


def write_whole(
    path: os.PathLike[str] | str,
    parts: Sequence[bytes],
    *,
    mode: int,
    times: tuple[int, int] | None = None,
    mark: str = "",
) -> None:
    """`write_atomic` for bytes already in memory: `parts` written in order by `writev` (not
    joined: no copy of them) to a temporary file, its access and modification `times` (ns) set,
    renamed over `path`; no file object, so a small file costs its system calls alone (the
    object cache writes one per small object). Not durable. `mark`: a kind of temporary a
    cleaner tells apart (`temporary_mark`)."""
    temporary = _temporary_for(path, mark)
    fd = create_file(temporary, os.O_WRONLY, mode)
    try:
        left = [memoryview(part) for part in parts if len(part)]
        while left:
            wrote = os.writev(fd, left)
            if not wrote:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(temporary))
            while left and wrote >= len(left[0]):
                wrote -= len(left.pop(0))
            if wrote:
                left[0] = left[0][wrote:]
        if times is not None:
            os.utime(fd, ns=times)
        os.close(fd)
        fd = -1
        os.replace(temporary, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _temporary_for(target: os.PathLike[str] | str, mark: str = "") -> str:
    """A new temporary file name beside `target`, naming its writer (see `temporary_writer`) and
    carrying `mark` (letters, see `temporary_mark`) before its random token. Strings, not
    pathlib: the object cache makes one per small object it writes."""
    token = _TOKENS.getrandbits(8 * _TOKEN)
    try:
        writer = _WRITER.name
    except AttributeError:
        writer = _WRITER.name = f"{_HOST}-{os.getpid()}-{threading.get_native_id()}"
    owner = f"{writer}.{mark}{token:0{2 * _TOKEN}x}.tmp"
    folder, name = os.path.split(os.fspath(target))
    name = os.fsencode(name)[: _NAME_MAX - len(owner) - 2].decode(errors="ignore")
    return os.path.join(folder, f".{name}.{owner}")


def temporary_mark(name: str) -> str:
    """The mark `write_whole` gave the temporary file `name` ("" if none, or not a temporary)."""
    if temporary_writer(name) is None:
        return ""
    token = name.rpartition(".tmp")[0].rsplit(".", 1)[-1]
    return token[: -2 * _TOKEN]


def temporary_writer(name: str) -> int | None:
    """The pid of the process of this machine writing the `write_atomic` temporary file `name`,
    or None when `name` is no temporary of this machine's (a cleaner removes those of dead pids)."""
    head, _, rest = name.rpartition(".tmp")
    if rest or not head.startswith("."):
        return None
    owner = head.rsplit(".", 2)[-2:]
    fields = owner[0].split("-") if len(owner) == 2 else []
    if len(fields) != 3 or fields[0] != _HOST or not fields[1].isdigit():
        return None
    return int(fields[1])

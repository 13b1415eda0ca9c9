"""Registry: the processes of the machine doing one thing, each with a number, in a cache folder.

The pools that fetch ahead divide the machine's budget of requests in flight by how many of them
live (`fetch_ahead`); the read-ahead leaves the cache the room every reading process may keep open
(`cache.ObjectCache.room_ahead`). Each process registers once per folder: one file named by its
pid holding its number (8 bytes), under an flock held while the process lives. A process that
dies releases its lock, so the others count it out and remove its file. A file is made under a
temporary name, locked, then renamed into place: a counting process never takes a live one's new
file for a dead one's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import struct
import threading

from globalloader import _paths
from globalloader.errors import StorageError

_VALUE = struct.Struct("<q")


class Registration:
    """This process's registration in `folder` (one per process and folder, `of`: an flock
    conflicts with the same process's other descriptors of the file)."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder, self.value = folder, 0
        _paths.make_folder(folder)
        _paths.check_folder(folder)
        temporary = folder / f".{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # left by a killed process of the same pid
        self._fd = _paths.create_file(temporary, os.O_RDWR, _paths.file_mode())
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(self._fd, _VALUE.pack(0), 0)
        os.rename(temporary, folder / str(os.getpid()))
        self._lock = threading.Lock()  # `add` from any thread, and from a `Share`'s finalizer

    @classmethod
    def of(cls, folder: pathlib.Path) -> Registration:
        """This process's registration in `folder` (made with the number 0 if there is none yet)."""
        with _LOCK:
            registration = _REGISTERED.get(folder)
            if registration is None:
                registration = _REGISTERED[folder] = cls(folder)
            return registration

    def add(self, change: int) -> None:
        """Change this process's number by `change` (one write)."""
        if change:
            with self._lock:
                self.value += change
                os.pwrite(self._fd, _VALUE.pack(self.value), 0)


class Share:
    """One owner's part of this process's number in a registration (several sources of a process
    each add their own), given back by `withdraw`: called when its owner is collected
    (`weakref.finalize`), so a source a process dropped stops counting while the process goes on."""

    def __init__(self, registration: Registration) -> None:
        self.registration, self.value, self._pid = registration, 0, os.getpid()

    def add(self, change: int) -> None:
        self.value += change
        self.registration.add(change)

    def withdraw(self) -> None:
        if os.getpid() == self._pid:  # a forked child's copy: the parent's registration, not its own
            self.registration.add(-self.value)
            self.value = 0


def live(folder: pathlib.Path) -> list[int]:
    """The numbers of the processes registered in `folder` and alive (the caller's own
    registration included: its lock conflicts with another descriptor of the file even in the
    same process); files of dead ones are removed."""
    values: list[int] = []
    names: list[str] = []
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as found:
        names = [item.name for item in found if item.name.isdigit()]
    for name in names:
        path = folder / name
        try:
            fd = _paths.open_file(path, os.O_RDONLY)[0]
        except (OSError, StorageError):  # gone, or a file another user could have written: not counted
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.pread(fd, _VALUE.size, 0)
            values.append(_VALUE.unpack(raw)[0] if len(raw) == _VALUE.size else 0)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        finally:
            os.close(fd)
    return values


_REGISTERED: dict[pathlib.Path, Registration] = {}
_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """A forked child is another process: the parent's registrations are not its own."""
    global _LOCK
    for registration in _REGISTERED.values():
        os.close(registration._fd)  # the parent's descriptor of the file keeps the parent's lock
    _REGISTERED.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)

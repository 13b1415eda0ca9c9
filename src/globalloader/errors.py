"""Errors raised by globalloader, all under one base class.

Every message names what is at fault (file, key, index or argument) and, where it helps, what to
do. Errors carry only a message string so they pickle across worker processes unchanged.

Two families matter for `on_error="skip"`: sample errors (`CorruptSampleError`,
`TransformError`: one sample's own bytes or function failed) may be skipped; everything else is
an infrastructure fault (a dead process, full shared memory, a server that stopped answering)
and always reaches the caller.
"""

from __future__ import annotations

import pickle
from numbers import Integral


class GlobalLoaderError(Exception):
    """Base class of every error this library raises on purpose."""


class ArgumentError(GlobalLoaderError, ValueError):
    """An argument has a wrong type or value; the message names the argument."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument has the wrong type where torch raises a TypeError for it (the DataLoader drop-in)."""


def check_int(value: object, what: str, low: int = 0) -> int:
    """An int argument >= `low` as a Python int (a NumPy integer is one too; a bool or a float is
    not), else an ArgumentError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ArgumentError(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


class SampleIndexError(GlobalLoaderError, IndexError):
    """An index is out of range for a source or dataset; the message gives the index and length."""


class SourceError(GlobalLoaderError):
    """A file cannot be found, opened or parsed (missing file, truncated tar, bad Parquet)."""


class StorageError(SourceError):
    """Object storage failed (`globalloader.storage`): the message names the URL and what was tried."""


class RemoteAccessError(StorageError):
    """A permanent remote fault (not found, access denied, bad credentials): never retried."""


class RemoteReadError(StorageError):
    """A transient remote fault (5xx, throttling, reset, timeout) outlasted the retries: the
    message gives the URL, the attempts made and the time spent."""


class CacheFullError(StorageError):
    """The machine-wide object cache cannot take an object: its disk is full, or the object is
    larger than the cache limit allows while the rest is in use."""


class CorruptSampleError(GlobalLoaderError):
    """One sample's bytes cannot be decoded; the message names the sample's key and file."""


class TransformError(GlobalLoaderError):
    """A map function raised on a sample; the message names the map, the sample index and key."""


class WorkerError(GlobalLoaderError, RuntimeError):
    """A worker process died (the message gives the signal or exit code and the task). A
    RuntimeError too, as torch's DataLoader raises it: code written for torch catches it."""


class LoaderTimeoutError(GlobalLoaderError, TimeoutError, RuntimeError):
    """A wait passed its deadline (`Loader(timeout=)`): the message says what was awaited. A
    RuntimeError too, as torch's DataLoader raises it: code written for torch catches it."""


class StateError(GlobalLoaderError):
    """A state dict does not fit the loader or dataset it is loaded into."""


class FingerprintError(GlobalLoaderError):
    """What decides a chain's output cannot be established (an opaque object reached by a map),
    so it cannot be shared, disk-cached or keyed; the message names the map, the value and how to
    give an explicit key."""


class MissingExtraError(GlobalLoaderError, ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


class SharedMemoryError(GlobalLoaderError):
    """Shared memory cannot be made or found (/dev/shm full or too small, a segment gone)."""


class ServiceError(GlobalLoaderError):
    """Base of the errors of the global loader service (`share=True`, `globalloader serve`)."""


class ServerStartError(ServiceError):
    """A server could not be started (bad --memory, /dev/shm too small, socket in use)."""


class ServerGoneError(ServiceError):
    """The server this job talked to closed its connection or died."""


class ServerTimeoutError(ServiceError, TimeoutError):
    """The server is alive but did not answer a request within its deadline."""


class ProtocolError(ServiceError):
    """A peer sent a malformed or oversized message, or runs as another user."""


class SharedPrefixError(ServiceError):
    """The server cannot run this job's shared prefix (it cannot unpickle or import it)."""


class PoolTooSmallError(ServiceError):
    """The server's memory pool cannot hold what its jobs need at once (a batch per job)."""


class SampleTooLargeError(ServiceError):
    """One decoded sample is larger than the server's whole memory pool."""


class ServerError(ServiceError):
    """The server failed while serving this job (a bug: the message carries its traceback line)."""


SAMPLE_ERRORS = (CorruptSampleError, TransformError)  # what on_error="skip" may skip


# What pickle raises for a value it cannot pickle: a lambda or local function, a lock, a generator.
UNPICKLABLE = (pickle.PicklingError, TypeError, AttributeError)


def unsendable(
    what: str, exc: BaseException, fix: str = "return picklable values (arrays, numbers, str and containers of them)"
) -> str:
    """The message of a TransformError for `what`, a value a worker process cannot send: pickle's
    error (one of `UNPICKLABLE`) and the fix, worded alike wherever a worker sends values."""
    return f"{what}: {type(exc).__name__}: {exc}; {fix}"

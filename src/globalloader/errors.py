"""Errors raised by globalloader, all under one base class.

Every message names what is at fault (file, key, index or argument) and, where it helps, what to
do. Errors carry only a message string so they pickle across worker processes unchanged.
"""

from __future__ import annotations


class GlobalLoaderError(Exception):
    """Base class of every error this library raises on purpose."""


class ArgumentError(GlobalLoaderError, ValueError):
    """An argument has a wrong type or value; the message names the argument."""


class SampleIndexError(GlobalLoaderError, IndexError):
    """An index is out of range for a source or dataset; the message gives the index and length."""


class SourceError(GlobalLoaderError):
    """A file cannot be found, opened or parsed (missing file, truncated tar, bad Parquet)."""


class CorruptSampleError(GlobalLoaderError):
    """One sample's bytes cannot be decoded; the message names the sample's key and file."""


class WorkerError(GlobalLoaderError):
    """A worker process died or a user function raised inside a worker."""


class StateError(GlobalLoaderError):
    """A state dict does not fit the loader or dataset it is loaded into."""


class MissingExtraError(GlobalLoaderError, ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


class ServerGone(GlobalLoaderError):
    """The global loader server stopped answering."""


class TransformError(GlobalLoaderError):
    """A map function raised on a sample; the message names the map, the sample index and key."""


class PoolTooSmall(GlobalLoaderError):
    """The server's memory pool cannot hold what its jobs need at once (a batch per job)."""


class FingerprintError(GlobalLoaderError):
    """What decides a chain's output cannot be established (an opaque object reached by a map),
    so it cannot be shared, disk-cached or keyed; the message names the map, the value and how to
    give an explicit key."""

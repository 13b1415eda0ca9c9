"""Running a chain: worker processes or threads, shared-memory transport, prefetch."""

from globalloader.execution.loader import Loader

__all__ = ["Loader"]

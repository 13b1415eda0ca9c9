"""Running a chain: worker processes or threads, shared-memory transport, prefetch; writing
its samples as shards with the same workers."""

from globalloader.execution.loader import Loader
from globalloader.execution.writer import write_shards

__all__ = ["Loader", "write_shards"]

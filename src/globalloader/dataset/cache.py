"""`Dataset.cache`: keep the output of the deterministic part of a chain, keyed by sample index.

In memory, each process keeps its own dict (right for `mode="thread"` or `workers=0`). On disk,
every worker and every later run share one folder named by the identity of the source and the
maps before the cache point (the same walk as the sharing key, see `dataset.fingerprint`), so a
changed source, transform or any value a transform reads never reads stale entries. An explicit
`key` stands for those maps when their identity cannot be established. Entries are written atomically (temp + rename),
so a crash leaves no half-written sample, and carry a CRC-32 of their pickle: an entry damaged on
disk (a flipped byte, or cut short by a power loss before the disk had it) is computed again,
never served.
"""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from globalloader.storage import read_whole, write_atomic

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder

MISSING = object()
_HEADER = b"glcache1"  # then the CRC-32 of the pickle (4 bytes, little-endian), then the pickle


class CacheOp:
    """A cache point in a chain: `get(index)` / `put(index, value)`."""

    def __init__(self, path: str | os.PathLike[str] | None, key: str | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.key = key
        self._folder: Path | None = None
        self._memory: dict[int, Any] = {}

    def attach(self, plan: Builder) -> None:
        plan.set_cache(self)

    def bind(self, fingerprint: str) -> None:
        """Name the disk folder after the fingerprint of everything before the cache point."""
        if self.path is not None:
            self._folder = self.path / fingerprint

    def get(self, index: int) -> Any:
        if self._folder is None:
            return self._memory.get(index, MISSING)
        try:
            data = memoryview(read_whole(self._folder / f"{index}.pkl"))
        except FileNotFoundError:
            return MISSING
        body, start = data[len(_HEADER) + 4 :], len(_HEADER)
        if data[:start] != _HEADER or int.from_bytes(data[start : start + 4], "little") != zlib.crc32(body):
            return MISSING  # damaged: put() writes it again
        return pickle.loads(body)

    def put(self, index: int, value: Any) -> None:
        if self._folder is None:
            self._memory[index] = value
            return
        self._folder.mkdir(parents=True, exist_ok=True)
        body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        # Not durable: an entry a crash damaged fails its CRC-32 and is computed again.
        with write_atomic(self._folder / f"{index}.pkl") as out:
            out.write(_HEADER + zlib.crc32(body).to_bytes(4, "little") + body)

    def __getstate__(self) -> dict[str, Any]:
        # Workers start with an empty memory cache rather than a pickled copy of the parent's.
        return {**self.__dict__, "_memory": {}}

    def describe(self) -> tuple[object, ...]:
        return ("cache",)

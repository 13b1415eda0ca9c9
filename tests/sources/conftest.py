"""Shared fixtures for the sources tests: small shard builders."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest

from globalloader.sources import TarWriter


@pytest.fixture
def make_shards(tmp_path: pathlib.Path) -> Callable[..., list[str]]:
    """Write `n` samples (`k000000`..., fields txt and cls) into shards of `per_shard` samples."""

    def make(n: int = 10, per_shard: int = 4, name: str = "shard") -> list[str]:
        with TarWriter(str(tmp_path / f"{name}-%06d.tar"), maxcount=per_shard) as writer:
            for i in range(n):
                writer.write({"__key__": f"k{i:06d}", "txt": f"sample {i}", "cls": i})
        return writer.paths

    return make

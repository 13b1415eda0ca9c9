"""Shared fixtures for the sources tests: small shard and Parquet builders."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
from storage.conftest import moto_server, proxy, s3  # noqa: F401  # the S3 server, for remote sources

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


@pytest.fixture
def write_parts(tmp_path: pathlib.Path) -> Callable[[Any], list[str]]:
    """Write a table's first 60 rows into one Parquet file in row groups of 16 (16, 16, 16, 12),
    the rest into a second in row groups of 7: uneven groups across two files."""

    def write(table: Any) -> list[str]:
        import pyarrow.parquet as pq

        paths = [str(tmp_path / "part-0.parquet"), str(tmp_path / "part-1.parquet")]
        pq.write_table(table.slice(0, 60), paths[0], row_group_size=16)
        pq.write_table(table.slice(60), paths[1], row_group_size=7)
        return paths

    return write

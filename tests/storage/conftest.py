"""A moto S3 server for the whole session, and a fresh fault proxy and bucket per test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_server.port)
    yield proxy
    proxy.stop()


@pytest.fixture
def s3(proxy: FaultProxy) -> dict[str, Any]:
    """A fresh bucket and the storage_options that reach it through the proxy."""
    return {"bucket": new_bucket(proxy.url), "options": options(proxy.url), "proxy": proxy}

"""The tests' S3 proxy (`globalloader.demo.s3.FaultProxy`) counts what its clients were sent."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from globalloader import storage


class _LateLock:
    """The proxy's lock, each hold taken 0.3 s late: a count made after a body is sent then comes
    well after its client holds the body."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        time.sleep(0.3)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_body_is_counted_before_its_client_holds_it(s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that snapshots `bytes_sent` right after a read must see that read counted."""
    proxy, bucket = s3["proxy"], s3["bucket"]
    fs, _ = storage.Store(s3["options"]).filesystem(f"s3://{bucket}")
    fs.pipe_file(f"{bucket}/object", b"x" * 1000)
    monkeypatch.setattr(proxy, "lock", _LateLock())
    assert fs.cat_file(f"{bucket}/object") == b"x" * 1000
    assert proxy.bytes_sent[f"/{bucket}/object"] == 1000

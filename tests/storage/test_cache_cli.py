"""`globalloader cache info|clear`, as a user runs it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from globalloader.storage.cache import Entry, ObjectCache


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "globalloader", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_cache_info_and_clear(isolated_cache: pathlib.Path) -> None:
    cache = ObjectCache()
    for _ in range(3):  # one download, then two opens served from the cache
        cache.open(Entry("s3://bucket/a.tar", 1000, "etag-1"), lambda write: write(b"a" * 1000)).close()
    info = run("cache", "info", GLOBALLOADER_CACHE_LIMIT="5GB")
    assert info.returncode == 0, info.stderr
    lines = dict(line.split(None, 1) for line in info.stdout.splitlines())
    assert lines == {
        "folder": str(isolated_cache / "objects"),
        "objects": "1",
        "size": "1,020 bytes",  # the data, its block's CRC-32 and the 16-byte trailer
        "limit": "5,000,000,000 bytes",
        "downloaded": "1,000 bytes",
        "misses": "1",
        "hits": "2",
    }
    cleared = run("cache", "clear")
    assert cleared.returncode == 0 and cleared.stdout.startswith("freed 1,020 bytes")
    assert ObjectCache().entries() == []
    bad = run("cache", "info", GLOBALLOADER_CACHE_LIMIT="lots")
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        "globalloader: GLOBALLOADER_CACHE_LIMIT must be a byte count such as 20GB, 512MiB or 1000000, got 'lots'"
    )

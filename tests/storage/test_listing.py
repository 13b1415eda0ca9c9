"""Listings of remote folders kept in the cache folder: mapped, not copied, by the processes of a
job; reused by other jobs only when asked (`listing_max_age`); a damaged one listed again."""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import pytest

import globalloader as gl
from globalloader import storage
from globalloader.errors import ArgumentError


def _put(s3: dict[str, Any], n: int) -> str:
    fs = storage.Store(s3["options"]).filesystem(f"s3://{s3['bucket']}")[0]
    fs.pipe({f"{s3['bucket']}/clips/{i:03d}.wav": b"clip %d" % i for i in range(n)})
    return f"s3://{s3['bucket']}/clips"


def _lists(s3: dict[str, Any]) -> int:
    """LIST requests on the bucket so far (GET of the bucket itself)."""
    return s3["proxy"].count("GET", f"/{s3['bucket']}", f"/{s3['bucket']}")


def test_a_kept_listing_is_mapped_by_workers_and_reused_only_when_asked(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    root = _put(s3, 30)
    src = gl.Files(root, storage_options=s3["options"])
    assert len(src) == 30 and _lists(s3) == 1
    sent = pickle.dumps(src)
    assert b"017.wav" not in sent  # the names stay in the file; a worker maps it again
    clone = pickle.loads(sent)
    assert [clone[i] for i in range(30)] == [src[i] for i in range(30)]
    assert _lists(s3) == 1
    gl.Files(root, storage_options=s3["options"])  # by default a new source lists again
    assert _lists(s3) == 2
    reused = gl.Files(root, storage_options=s3["options"], listing_max_age=3600)
    assert _lists(s3) == 2 and reused.fingerprint == src.fingerprint  # another job: no listing
    kept = sorted((isolated_cache / "listings").iterdir())
    assert len(kept) == 2  # one file per listing: a job's workers map the one it was made from
    kept[-1].write_bytes(kept[-1].read_bytes()[:-8])  # cut short
    again = gl.Files(root, storage_options=s3["options"], listing_max_age=3600)
    assert _lists(s3) == 3 and again.fingerprint == src.fingerprint
    with pytest.raises(ArgumentError, match="listing_max_age"):
        gl.Files(root, storage_options=s3["options"], listing_max_age=-1)

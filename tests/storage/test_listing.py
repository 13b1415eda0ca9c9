"""Listings of remote folders kept in the cache folder: mapped, not copied, by the processes of a
job; shared by jobs that start together, reused by later ones only when asked (`listing_max_age`);
a damaged one listed again."""

from __future__ import annotations

import os
import pathlib
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends

import globalloader as gl
from globalloader import storage
from globalloader.errors import ArgumentError
from globalloader.storage import listing
from helpers import at_once


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
    kept = sorted((isolated_cache / "listings").glob("*.gll"))
    assert len(kept) == 2  # one file per listing: a job's workers map the one it was made from
    kept[-1].write_bytes(kept[-1].read_bytes()[:-8])  # cut short
    again = gl.Files(root, storage_options=s3["options"], listing_max_age=3600)
    assert _lists(s3) == 3 and again.fingerprint == src.fingerprint
    with pytest.raises(ArgumentError, match="listing_max_age"):
        gl.Files(root, storage_options=s3["options"], listing_max_age=-1)


def test_by_default_a_source_asked_for_while_its_folder_is_listed_maps_that_listing(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    """Jobs that start together list once even without listing_max_age; one made later lists again."""
    root = _put(s3, 30)
    store = storage.Store(s3["options"])
    folder, key = isolated_cache / "listings", listing._key(root, store.storage_options)
    folder.mkdir(parents=True, exist_ok=True)
    made: list[Any] = []
    with listing._listing_lock(folder / f"{key}.lock", root):  # another job is listing the folder
        waiter = threading.Thread(target=lambda: made.append(gl.Files(root, storage_options=s3["options"])))
        waiter.start()
        time.sleep(1.0)  # the waiter asks while the listing is under way (ordering, not timing)
        listed = listing._list(store, root, folder, key)
    waiter.join(60)
    assert _lists(s3) == 1 and [made[0][i]["bytes"] for i in range(30)] == [b"clip %d" % i for i in range(30)]
    assert made[0].fingerprint == gl.Files(root, storage_options=s3["options"]).fingerprint
    assert _lists(s3) == 2  # a source made once the listing is done lists again
    assert len(listed) == 30


def _put_fast(s3: dict[str, Any], keys: list[str]) -> None:
    """Objects put through the in-process moto server's own store (thousands of PUTs over HTTP
    would take most of a minute); reading and listing them still go through the proxy."""
    store = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for key in keys:
        store.put_object(s3["bucket"], key, key.encode())


def test_what_a_source_makes_of_a_listing_is_kept_once_and_sent_as_its_file(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    _put_fast(s3, [f"pets/{kind}/{i:03d}.jpg" for kind in ("cat", "dog", "eel") for i in range(100)])
    root, opts = f"s3://{s3['bucket']}/pets", s3["options"]
    src = gl.ImageFolder(root, storage_options=opts, listing_max_age=3600)
    made = list((isolated_cache / "listings").glob("*.gld"))  # its rows in its order, and labels
    assert len(made) == 1 and src.classes == ["cat", "dog", "eel"]
    before = made[0].stat()
    again = gl.ImageFolder(root, storage_options=opts, listing_max_age=3600)  # another job
    after = made[0].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # mapped, not made again
    labels = [0] * 100 + [1] * 100 + [2] * 100
    assert again.classes == src.classes and list(again.labels) == labels
    assert [again.relative_path(i) for i in range(300)] == [src.relative_path(i) for i in range(300)]
    sent = pickle.dumps(src)
    assert np.asarray(src.labels).tobytes() not in sent  # a worker maps the file: no copy of the labels
    clone = pickle.loads(sent)
    assert list(clone.labels) == list(src.labels) and clone[150] == src[150]
    gl.Files(root, "*.jpg", storage_options=opts, listing_max_age=3600)  # another selection: its own file
    assert len(list((isolated_cache / "listings").glob("*.gld"))) == 2
    made[0].write_bytes(made[0].read_bytes()[:-8])  # cut short: made again, never read as whole
    remade = gl.ImageFolder(root, storage_options=opts, listing_max_age=3600)
    assert list(remade.labels) == labels and remade.classes == ["cat", "dog", "eel"]


def _mapped_listings(record: dict[str, Any]) -> dict[str, Any]:
    """In a loader's worker: its pid and the kept listings (and what was made of them) it maps."""
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if line.rstrip().endswith((".gll", ".gld"))})
    return {"pid": os.getpid(), "mapped": mapped}


def _job(root: str, opts: dict[str, Any], out: Any, start: Any) -> None:
    """A job: its source made at the same moment as the other job's, read by 2 process workers."""
    start.wait(60)
    src = gl.Files(root, storage_options=opts, listing_max_age=3600)
    chain = gl.Dataset(src).select(range(0, len(src), 500)).map(_mapped_listings)
    with gl.Loader(chain, workers=2) as loader:
        out.put((os.getpid(), len(src), list(loader)))


@pytest.mark.slow
def test_jobs_starting_together_list_a_folder_once_and_their_workers_map_it(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    _put_fast(s3, [f"many/{i:05d}.npy" for i in range(2500)])  # a listing of 3 pages of 1,000 keys
    root = f"s3://{s3['bucket']}/many"
    results = at_once("spawn", _job, root, s3["options"])
    assert _lists(s3) == 3  # one listing of the folder for the machine: not one per job
    kept = sorted(str(p) for p in (isolated_cache / "listings").glob("*.gl[ld]"))
    assert len(kept) == 2  # the listing and the source's rows
    for pid, count, rows in results:
        assert count == 2500 and len(rows) == 5
        assert all(row["pid"] != pid for row in rows)  # read in the job's worker processes
        assert all(row["mapped"] == kept for row in rows)  # which map the one kept listing

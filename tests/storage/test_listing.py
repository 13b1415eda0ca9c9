"""Listings of remote folders kept in the cache folder: mapped, not copied, by the processes of a
job; shared by jobs that start together, reused by later ones only when asked (`listing_max_age`);
a damaged one listed again."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
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


def _s3fs_listing(s3: dict[str, Any], root: str) -> dict[str, storage.FileStat]:
    """What s3fs's own listing names below `root`: URL -> (size, ETag)."""
    fs = storage.Store(s3["options"]).filesystem(root)[0]
    found = fs.find(root, detail=True, refresh=True)
    return {f"s3://{name}": storage.FileStat(info["size"], info["ETag"]) for name, info in found.items()}


def _put_keys(s3: dict[str, Any], keys: dict[str, bytes]) -> None:
    """Objects under these exact keys (boto3: no client-side normalising of the names)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3["options"]["endpoint_url"], **_boto3_credentials(s3))
    for key, body in keys.items():
        client.put_object(Bucket=s3["bucket"], Key=key, Body=body)


def _boto3_credentials(s3: dict[str, Any]) -> dict[str, str]:
    options = s3["options"]
    return {
        "aws_access_key_id": options["key"],
        "aws_secret_access_key": options["secret"],
        "region_name": options["client_kwargs"]["region_name"],
    }


def test_an_s3_folder_listed_through_obstore_names_what_s3fs_names(s3: dict[str, Any]) -> None:
    """A folder of S3 is listed through obstore (no s3fs import, no botocore client): the same
    URLs, sizes and ETags as s3fs's listing, over more than one page of the store's answers."""
    keys = {f"f/c{i % 3}/{i:04d}.jpg": b"x" * (1 + i % 7) for i in range(1005)}
    keys |= {"f/sp ace.jpg": b"sp", "f/ünï.jpg": b"u", "f/%41.jpg": b"pct", "f/q?x=1.jpg": b"q", "g/other.jpg": b"o"}
    _put_keys(s3, keys)
    root = f"s3://{s3['bucket']}/f"
    quick = storage._fs.list_s3_quickly(s3["options"], s3["bucket"], "f/")
    assert quick is not None and len(quick) == len(keys) - 1  # every page, not g/
    expected = _s3fs_listing(s3, root)
    assert {f"s3://{s3['bucket']}/{key}": storage.FileStat(size, etag) for key, size, etag in quick} == expected
    assert storage.Store(s3["options"]).find(root) == expected
    assert storage.Store(s3["options"]).find(root + "/") == expected


@pytest.mark.parametrize(
    "odd",
    [
        {"f/x//y.jpg": b"empty segment"},
        {"f/./d.jpg": b"dot"},
        {"f/../e.jpg": b"dot dot"},
        {"f/t\tab.jpg": b"control character"},
        {"f/dir/": b""},  # a folder marker: obstore would name it f/dir
        {"f/dir/": b"", "f/dir": b"a file of the marker's name"},
        {"f/empty.json": b""},  # no telling a zero-byte object from a marker
    ],
    ids=["empty-segment", "dot", "dot-dot", "control", "marker", "marker-and-file", "zero-bytes"],
)
def test_keys_obstore_cannot_name_as_they_are_go_through_s3fs(s3: dict[str, Any], odd: dict[str, bytes]) -> None:
    _put_keys(s3, {"f/a.jpg": b"a", "f/b/c.jpg": b"c", **odd})
    root = f"s3://{s3['bucket']}/f"
    assert storage._fs.list_s3_quickly(s3["options"], s3["bucket"], "f/") is None
    found = storage.Store(s3["options"]).find(root)
    assert found == _s3fs_listing(s3, root) and {f"{root}/a.jpg", f"{root}/b/c.jpg"} <= found.keys()


def test_a_bucket_is_listed_whole_through_s3fs_and_an_object_asked_as_a_folder_too(s3: dict[str, Any]) -> None:
    """A bucket's whole listing never goes through obstore, which drops a key's leading "/"
    (`/lead.jpg` would be named as `lead.jpg`, another object); nor does a URL that is an object
    (s3fs lists it as itself)."""
    _put_keys(s3, {"/lead.jpg": b"lead", "top.jpg": b"top", "f/a.jpg": b"a"})
    bucket = f"s3://{s3['bucket']}"
    found = storage.Store(s3["options"]).find(bucket)
    assert found == _s3fs_listing(s3, bucket) and f"{bucket}//lead.jpg" in found and f"{bucket}/lead.jpg" not in found
    assert storage.Store(s3["options"]).find(f"{bucket}/top.jpg") == _s3fs_listing(s3, f"{bucket}/top.jpg")


_NO_S3FS = """
import sys, time, numpy as np, globalloader as gl
from globalloader import storage
src = gl.Files(sys.argv[1], "*.bin", storage_options={options!r})
src.prefetch(np.arange(len(src)))
while src.store.fetch_counters()["fetched"] + src.store.fetch_counters()["failed"] < len(src):
    time.sleep(0.01)  # each read then a hit: a reader that gets to an object first fetches it itself
got = [bytes(src[i]["bytes"]) for i in range(len(src))]
made = [key for key in storage._fs._INSTANCES if key[1] == "s3"]  # s3fs's clients
print(len(got), sum(map(len, got)), src.store.fetch_counters()["fetched"], made, "s3fs" in sys.modules)
"""


def test_a_job_reading_an_s3_folder_ahead_makes_no_s3fs_client(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """Importing s3fs (with botocore and aiohttp) and making its client are most of a job's time
    to its first GET: a folder listed through obstore and read by the pool ahead does neither
    (a worker's own GET of an object the pool has not claimed goes through s3fs, imported then)."""
    _put_keys(s3, {f"o/{i:03d}.bin": bytes([i]) * 100 for i in range(40)})
    env = dict(os.environ, GLOBALLOADER_CACHE_DIR=str(tmp_path / "cache"))
    script = _NO_S3FS.format(options=s3["options"])
    done = subprocess.run(
        [sys.executable, "-c", script, f"s3://{s3['bucket']}/o"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["40", "4000", "40", "[]", "False"]  # nor is s3fs imported


_FORK_AFTER_LISTING = """
import faulthandler, multiprocessing, os, signal, sys, time
from globalloader import storage
store = storage.Store({options!r})
assert store.find(sys.argv[1])  # through obstore

def child(url):
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung child's stacks, on the parent's ask
    stat = store.stat(url)  # a HEAD through s3fs: obstore cannot serve a process forked after its use
    print(stat.size, storage.Store({options!r}).read_range(url, 0, stat.size) == b"x" * stat.size, flush=True)

if __name__ == "__main__":
    process = multiprocessing.get_context("fork").Process(target=child, args=(sys.argv[1] + "/0.bin",))
    process.start()
    process.join(60)
    if process.exitcode is None:  # hung: its stacks on stderr, then ended (else the exit would wait for it)
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(2)
        process.kill()
        process.join(10)
        print("hung")
    print(process.exitcode)
"""


def test_a_process_forked_after_a_listing_through_obstore_reads_through_s3fs(
    s3: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    """A child forked right after a listing through obstore (whose runtime it cannot use) reads
    through s3fs, which it imports itself, and neither hangs nor fails."""
    _put_keys(s3, {"k/0.bin": b"x" * 10, "k/1.bin": b"x" * 20})
    env = dict(os.environ, GLOBALLOADER_CACHE_DIR=str(tmp_path / "cache"))
    script = _FORK_AFTER_LISTING.format(options=s3["options"])
    command = [sys.executable, "-c", script, f"s3://{s3['bucket']}/k"]
    for _ in range(3):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["10", "True", "0"], done.stderr[-6000:]  # a hung child's stacks


def test_names_read_back_as_written_from_a_mapped_file_and_after_pickling(tmp_path: pathlib.Path) -> None:
    names = ["a.jpg", "", "dir/é.png", os.fsdecode(b"raw-\xff.bin"), "x" * 300, "日本.npy"]
    offsets, data = listing._Flat.encode(names)
    (tmp_path / "names").write_bytes(data)
    mapped = listing._Flat(offsets, np.memmap(tmp_path / "names", np.uint8, mode="r"))
    assert [mapped[i] for i in range(len(names))] == names  # a lone surrogate too (surrogatepass)
    in_memory = listing.flat_strings(names)
    clone = pickle.loads(pickle.dumps(in_memory))  # a local folder's names go to workers this way
    assert [clone[i] for i in range(len(names))] == names

"""The pool of downloads ahead: many small objects, many GETs in flight, through a real S3 server
(moto) behind the fault proxy: exact epochs under throttling, the concurrency it gives up, its
bounds, and objects deleted or rewritten after the listing."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader import storage
from globalloader.errors import RemoteAccessError, SourceError
from globalloader.storage import fetch_ahead
from globalloader.storage.registry import live


def _folder(s3: dict[str, Any], n: int, size: int = 0) -> dict[str, bytes]:
    """`n` objects under images/ (of `size` bytes, else 200-2,000), by key relative to it."""
    rng = np.random.default_rng(n)
    objects = {f"c{i % 3}/{i:04d}.jpg": rng.bytes(size or int(rng.integers(200, 2000))) for i in range(n)}
    fs = storage.Store(s3["options"]).filesystem(f"s3://{s3['bucket']}")[0]
    fs.pipe({f"{s3['bucket']}/images/{key}": data for key, data in objects.items()})
    return objects


def _wait_for(store: storage.Store, done: int) -> dict[str, int]:
    """The pool's counters once `done` objects were fetched or failed for good."""
    deadline = time.monotonic() + 60
    while True:
        counters = store.fetch_counters()
        if counters and counters["fetched"] + counters["failed"] >= done and counters["in_flight"] == 0:
            return counters
        assert time.monotonic() < deadline, f"the pool never finished: {counters}"
        time.sleep(0.01)


def test_an_exact_epoch_under_throttling_with_many_requests_in_flight(s3: dict[str, Any]) -> None:
    """10% of GETs answered 503 SlowDown while the loader fetches the whole epoch ahead: every
    object once with its bytes, and the pool halved its concurrency instead of hammering."""
    objects = _folder(s3, 160)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/images/"
    src = gl.Files(f"s3://{s3['bucket']}/images", "*.jpg", storage_options=s3["options"])
    assert len(src) == len(objects)
    # 100 ms a request: long enough for a limit of requests to be started while the first wait.
    proxy.latency, proxy.slowdown, proxy.faults_on = 0.1, 0.1, True
    with gl.Loader(gl.Dataset(src).shuffle(seed=0).batch(16), workers=2) as loader:
        seen = [(k, b) for batch in loader for k, b in zip(batch["__key__"], batch["bytes"], strict=True)]
    assert sorted(k for k, _ in seen) == sorted(objects)  # every object once
    assert all(objects[k] == b for k, b in seen)  # its own bytes
    counters = _wait_for(src.store, len(objects))
    assert proxy.faults["503"] > 0 and counters["throttled"] > 0
    assert counters["peak_in_flight"] >= 32  # many at once, not a few per process
    assert counters["lowest_limit"] <= counters["ceiling"] // 4  # throttling lowered it
    assert counters["failed"] == 0
    # Each object's bytes crossed the wire once however many tried (503s carry no body).
    assert proxy.total_bytes(prefix) == sum(map(len, objects.values()))


def test_throttling_lowers_the_limit_and_successes_raise_it_again(s3: dict[str, Any]) -> None:
    objects = _folder(s3, 120, size=100)
    proxy = s3["proxy"]
    src = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"], fetch_concurrency=64)
    proxy.slowdown, proxy.faults_on = 0.3, True
    src.prefetch(np.arange(60))
    throttled = _wait_for(src.store, 60)
    assert throttled["throttled"] > 0 and throttled["limit"] < 32
    proxy.faults_on = False
    src.prefetch(np.arange(60, 120))
    after = _wait_for(src.store, 120)
    assert after["limit"] > throttled["limit"]  # +1 per round of successes
    assert all(src[i]["bytes"] == objects[src.relative_path(i)] for i in range(len(src)))


def test_the_first_gets_are_answered_before_more_join_them_then_the_limit_doubles(s3: dict[str, Any]) -> None:
    """A slow start: the first SLOW_START GETs (the first batch's objects) are not answered
    alongside a hundred others that a slow store or link serves at the same time; each answer
    then raises the limit by one, so it doubles every round trip up to the ceiling."""
    _folder(s3, 100, size=100)
    proxy = s3["proxy"]
    proxy.latency = 1.0  # a round trip far longer than sending a round's GETs
    src = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"], fetch_concurrency=128)
    proxy.count_peak_afresh()
    src.prefetch(np.arange(100))
    deadline = time.monotonic() + 10
    while proxy.in_flight < fetch_ahead.SLOW_START:
        assert time.monotonic() < deadline, f"{proxy.in_flight} GETs in flight"
        time.sleep(0.01)
    time.sleep(0.3)  # no answer yet: no GET more
    assert proxy.in_flight == proxy.most_in_flight == fetch_ahead.SLOW_START
    counters = _wait_for(src.store, 100)
    assert counters["peak_in_flight"] >= 2 * fetch_ahead.SLOW_START and counters["limit"] == counters["ceiling"] == 128
    assert counters["fetched"] == 100 and proxy.count("GET", f"/{s3['bucket']}/images/") == 100


def test_a_reader_waits_for_the_pools_get_of_an_object_the_slow_start_holds_back(s3: dict[str, Any]) -> None:
    """The pool claims the objects it queued up to its ceiling, not only those the slow start lets
    in flight: a reader that gets to one of the others first (another handle on the machine's
    cache, as a worker is) waits for the pool's GET instead of making its own. Before, at every
    job's start, a worker whose first batch was past the slow start's GETs fetched one itself."""
    objects = _folder(s3, 100, size=100)
    proxy = s3["proxy"]
    src = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"], fetch_concurrency=128)
    key = src.relative_path(50)  # to be claimed, its GET not started
    url = f"s3://{s3['bucket']}/images/{key}"
    reader = storage.Store(s3["options"])
    stat = reader.stat(url)
    proxy.latency = 0.5  # the first round's answers come after the read below starts
    src.prefetch(np.arange(100))
    deadline = time.monotonic() + 10
    while proxy.in_flight < fetch_ahead.SLOW_START:
        assert time.monotonic() < deadline, f"{proxy.in_flight} GETs in flight"
        time.sleep(0.01)
    assert src.store.fetch_counters()["claimed"] == 100 - fetch_ahead.SLOW_START
    assert reader.read_object(url, stat) == objects[key]
    counters = _wait_for(src.store, 100)
    assert counters["fetched"] == 100 and counters["claimed"] == 0
    assert counters["skipped"] == 0  # the pool made every GET: none was overtaken by the reader's own
    assert proxy.count("GET", f"/{s3['bucket']}/images/") == 100


def test_in_flight_requests_memory_and_bytes_ahead_are_bounded(s3: dict[str, Any]) -> None:
    _folder(s3, 40, size=1000)
    proxy = s3["proxy"]
    proxy.latency = 0.02  # answers overlap
    src = gl.Files(
        f"s3://{s3['bucket']}/images",
        storage_options=s3["options"],
        fetch_concurrency=8,
        fetch_memory=5000,  # five answers of 1,000 bytes
        cache_limit=40_000,  # fetched and not read yet: half of it, 19 entries of 1,020 bytes
    )
    proxy.count_peak_afresh()
    src.prefetch(np.arange(40))
    counters = _wait_for(src.store, 19)
    time.sleep(0.2)  # the others wait for the reads, however long
    counters = src.store.fetch_counters()
    assert counters["peak_in_flight"] == 5 and proxy.most_in_flight <= 5
    assert counters["peak_memory"] <= 5000
    assert counters["fetched"] == 19 and counters["queued"] == 21 and counters["dropped"] == 0
    for i in range(len(src)):  # reading makes room: the others are fetched ahead of their reads
        assert len(src[i]["bytes"]) == 1000
    assert _wait_for(src.store, 40)["dropped"] == 0
    assert proxy.count("GET", f"/{s3['bucket']}/images/", ".jpg") == 40  # none twice


def test_an_object_deleted_after_the_listing_is_a_named_error_never_retried(s3: dict[str, Any]) -> None:
    _folder(s3, 12)
    proxy = s3["proxy"]
    src = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"])
    gone = src.relative_path(5)
    url = f"s3://{s3['bucket']}/images/{gone}"
    src.store.filesystem(url)[0].rm(url)
    src.prefetch(np.arange(len(src)))
    counters = _wait_for(src.store, len(src))
    assert counters["failed"] == 1 and url in counters_errors(src)
    assert proxy.count("GET", f"/{s3['bucket']}/images/{gone}") == 1  # a 404 is not asked again
    with pytest.raises(RemoteAccessError, match=f"file not found: {url}"):
        src[5]
    assert src[6]["__key__"] == src.relative_path(6)


def counters_errors(src: gl.Files) -> str:
    pool = src.store._fetch_ahead
    assert pool is not None
    return "\n".join(pool.errors)


@pytest.mark.parametrize("rewrite", ["same size", "larger", "shorter", "empty"])
def test_an_object_rewritten_after_the_listing_is_never_served_under_the_old_version(
    s3: dict[str, Any], rewrite: str
) -> None:
    objects = _folder(s3, 12, size=500)
    src = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"])
    key = src.relative_path(3)
    url = f"s3://{s3['bucket']}/images/{key}"
    old = objects[key]
    new = {"same size": old[::-1], "larger": old + b"x", "shorter": old[:-1], "empty": b""}[rewrite]
    src.store.filesystem(url)[0].pipe_file(url, new)
    src.prefetch(np.arange(len(src)))
    counters = _wait_for(src.store, len(src))
    assert counters["failed"] == 1 and f"{url} changed since the source was made" in counters_errors(src)
    with pytest.raises(SourceError, match=f"{url} changed since the source was made"):
        src[3]
    again = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"])
    assert again[3]["bytes"] == new  # listed again: the new version


def test_a_small_object_ahead_is_one_read_without_a_condition_checked_against_its_etag(s3: dict[str, Any]) -> None:
    """The pool reads a small object whose ETag is an MD5 in one GET without If-Match (its bytes'
    MD5 pins the version); bytes corrupted on the way are read again with If-Match, and the
    objects fetched after that still without (a corrupted transfer says nothing of the bucket)."""
    objects = _folder(s3, 24, size=700)
    proxy = s3["proxy"]
    src = gl.Files(f"s3://{s3['bucket']}/images", storage_options=s3["options"])
    damaged = src.relative_path(4)
    proxy.corrupt[damaged] = 1
    src.prefetch(np.arange(12))
    assert _wait_for(src.store, 12)["failed"] == 0
    assert proxy.faults["corrupt"] == 1
    assert proxy.count_conditional("GET", ".jpg") == 1 == proxy.count_conditional("GET", damaged)
    src.prefetch(np.arange(12, 24))  # all asked for once the corruption was caught
    assert _wait_for(src.store, 24)["failed"] == 0
    assert proxy.count("GET", f"/{s3['bucket']}/images/", ".jpg") == 25  # one each, the damaged one twice
    assert proxy.count_conditional("GET", ".jpg") == 1
    assert [src[i]["bytes"] for i in range(len(src))] == [objects[src.relative_path(i)] for i in range(len(src))]
    assert proxy.count("GET", f"/{s3['bucket']}/images/", ".jpg") == 25  # served from the cache


def test_processes_fetching_ahead_share_the_machine_budget(tmp_path: pathlib.Path) -> None:
    """Each process that fetches ahead registers in the cache folder; the budget is divided by
    those alive, and one that ended returns its share."""
    folder = tmp_path / "fetchers"
    holder = (
        "import pathlib, sys\n"
        "from globalloader.storage.registry import Registration\n"
        f"Registration.of(pathlib.Path({str(folder)!r}))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    other = subprocess.Popen([sys.executable, "-c", holder], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert other.stdout is not None and other.stdout.readline() == b"ready\n"
        pool = fetch_ahead.FetchAhead(_never, fetch_ahead.client_loop(), concurrency=128, memory=1 << 20, share=folder)
        assert pool.counters()["ceiling"] == 64
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
    assert len(live(folder)) == 1  # the ended one's file is removed
    assert [p.name for p in folder.iterdir()] == [str(os.getpid())]


async def _never(url: str, stat: object) -> None:
    raise AssertionError(f"nothing is requested: {url}")


def test_the_first_answers_are_read_before_a_whole_limit_of_requests_is_sent() -> None:
    """Sending a request costs the client CPU: the pool starts a few per turn of the event loop,
    so the first objects (those the first batch waits for) finish while the others are being
    sent, instead of after all of them."""
    events: list[tuple[str, int]] = []
    done = asyncio.Event()

    async def fetch(url: str, number: int) -> None:
        events.append(("sent", number))
        await asyncio.sleep(0)  # the answer: at the next turn of the loop
        events.append(("done", number))
        if len(events) == 2 * 64:
            done.set()

    loop = asyncio.new_event_loop()
    try:
        pool = fetch_ahead.FetchAhead(fetch, loop, concurrency=64, memory=1 << 20)
        pool.request((f"s3://b/{i}", 1, i) for i in range(64))
        loop.run_until_complete(asyncio.wait_for(done.wait(), 30))
    finally:
        loop.close()
    assert events.index(("done", 0)) < events.index(("sent", 63))
    assert sorted(number for kind, number in events if kind == "done") == list(range(64))  # each once


def test_closing_the_pool_releases_the_claims_its_gets_never_started() -> None:
    """Objects claimed ahead of their GETs (the slow start holds them back) are released when the
    pool closes, so their readers fetch them instead of waiting for a GET that never comes; those
    in flight are released when their GETs end."""
    released: list[int] = []
    answer = asyncio.Event()

    async def fetch(url: str, number: int) -> None:
        await answer.wait()

    loop = asyncio.new_event_loop()
    try:
        pool = fetch_ahead.FetchAhead(
            fetch, loop, concurrency=64, memory=1 << 20, claim=lambda url, i: (i, lambda: released.append(i))
        )
        pool.request((f"s3://b/{i}", 1, i) for i in range(100))
        loop.run_until_complete(asyncio.sleep(0.05))
        counters = pool.counters()
        assert counters["in_flight"] == fetch_ahead.SLOW_START and counters["claimed"] == 64 - fetch_ahead.SLOW_START
        pool.close(timeout=0)
        assert sorted(released) == list(range(fetch_ahead.SLOW_START, 64))
        assert pool.counters()["dropped"] == 100 - fetch_ahead.SLOW_START and pool.counters()["claimed"] == 0
        answer.set()
        loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        loop.close()
    assert sorted(released) == list(range(64))  # each once


def test_an_object_whose_claim_fails_is_a_named_failure_and_the_others_are_fetched() -> None:
    """The cache refusing a claim (its lock file unreadable, say) fails that object alone, named in
    the pool's errors (its reader fetches it and reports what fails); one failing to tell its
    room once (an I/O error: transient) has that object tried again. The pool goes on."""
    fetched: list[int] = []
    rooms: list[int] = []

    def room(size: int, under_way: int) -> bool:
        rooms.append(size)
        if len(rooms) == 7:  # the object 6's
            raise OSError(5, "Input/output error", "stats")
        return True

    def claim(url: str, i: int) -> tuple[int, Any]:
        if i == 3:
            raise PermissionError(13, "Permission denied", "locks/downloads")
        return i, lambda: None

    async def fetch(url: str, i: int) -> None:
        fetched.append(i)

    loop = asyncio.new_event_loop()
    try:
        pool = fetch_ahead.FetchAhead(fetch, loop, concurrency=8, memory=1 << 20, room=room, claim=claim)
        pool.request((f"s3://b/{i}", 1, i) for i in range(10))
        deadline = time.monotonic() + 30
        while len(fetched) < 9 and time.monotonic() < deadline:  # the retry comes after a backoff
            loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        loop.close()
    counters = pool.counters()
    assert sorted(fetched) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert counters["failed"] == 1 and counters["retried"] == 1 and counters["fetched"] == 9
    assert counters["claimed"] == 0
    assert list(pool.errors) == ["s3://b/3: PermissionError: [Errno 13] Permission denied: 'locks/downloads'"]


def test_disk_work_runs_calls_in_order_off_the_loop_and_hands_back_their_errors() -> None:
    """The pool's disk work: each call once, in the order asked, on another thread than the
    loop's; a call's exception reaches the coroutine that awaits it; a call whose awaiting was
    cancelled before it started is not made."""
    calls: list[tuple[int, int]] = []
    gate = threading.Event()

    def work(number: int) -> None:
        gate.wait(30)  # the first call holds the drain while the others queue behind it
        calls.append((number, threading.get_ident()))
        if number == 3:
            raise OSError(28, "No space left on device")

    async def main() -> list[object]:
        disk = fetch_ahead.DiskWork(asyncio.get_running_loop())
        futures = [disk.run(work, n) for n in range(6)]
        futures[4].cancel()
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 30)

    loop = asyncio.new_event_loop()
    try:
        outcomes = loop.run_until_complete(main())
        loop_thread = threading.get_ident()
    finally:
        loop.close()
    assert [number for number, _ in calls] == [0, 1, 2, 3, 5]
    assert all(thread != loop_thread for _, thread in calls)
    assert isinstance(outcomes[3], OSError) and isinstance(outcomes[4], asyncio.CancelledError)
    assert [outcomes[n] for n in (0, 1, 2, 5)] == [None] * 4


_EXIT_EARLY = """
import sys, numpy as np, globalloader as gl
src = gl.Files(sys.argv[1], "*.jpg", storage_options={options!r})
src.prefetch(np.arange(len(src)))
while src.store.fetch_counters().get("fetched", 0) < 5:
    pass
"""


@pytest.mark.slow
def test_a_process_ending_with_gets_in_flight_exits_cleanly(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """A job that ends (or fails) while its pool has GETs in flight exits with 0, not a crash:
    the pool waits for them at exit before the interpreter finalizes (answers arriving from the S3
    client's runtime after that killed the process with SIGSEGV in about half of such exits)."""
    _folder(s3, 300, size=15_000)
    s3["proxy"].latency = 0.02  # many GETs still in flight when the script ends
    script = _EXIT_EARLY.format(options=s3["options"])
    codes = []
    for run in range(6):
        env = dict(os.environ, GLOBALLOADER_CACHE_DIR=str(tmp_path / str(run)))
        url = f"s3://{s3['bucket']}/images"
        done = subprocess.run([sys.executable, "-c", script, url], env=env, capture_output=True, timeout=120)
        codes.append((done.returncode, done.stderr.decode()[-300:]))
    assert codes == [(0, "")] * 6

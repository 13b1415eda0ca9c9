"""The global loader with real server processes, real client processes and real shared memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ServerGoneError, StateError
from globalloader.service.decoder import LOADS_PER_WORKER
from globalloader.service.launcher import request
from helpers import Server, pool_segments

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def epochs(path: Path) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for row in lines(path):
        if "epoch" in row:
            seen.setdefault(row["epoch"], Counter()).update(row["indices"])
    return seen


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out


def wait_for_rows(path: Path, n: int) -> None:
    deadline = time.monotonic() + 30
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.05)


def test_three_concurrent_jobs_each_see_their_set_once_per_epoch_and_share_decodes(server, tmp_path):
    sets = {"a": (20, 300), "b": (20, 300), "c": (100, 250)}
    procs = {
        name: server.job(tmp_path / f"{name}.jsonl", "--start", str(lo), "--stop", str(hi), "--epochs", "2")
        for name, (lo, hi) in sets.items()
    }
    for proc in procs.values():
        finish(proc)
    for name, (lo, hi) in sets.items():
        seen = epochs(tmp_path / f"{name}.jsonl")
        assert set(seen) == {0, 1}
        for epoch, counts in seen.items():
            assert counts == Counter(range(lo, hi)), f"job {name} epoch {epoch}"
    status = request(server.socket, "status")[1]
    requests = 2 * (280 + 280 + 150)
    assert status["requests"] == requests
    assert status["decodes"] < requests, "no decode was shared"


def test_a_job_killed_mid_epoch_is_removed_and_the_others_finish(server, tmp_path):
    victim = server.job(tmp_path / "victim.jsonl", "--start", "20", "--sleep", "0.2")
    wait_for_rows(tmp_path / "victim.jsonl", 2)
    other = server.job(tmp_path / "other.jsonl", "--start", "20", "--sleep", "0.01")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    finish(other)
    assert epochs(tmp_path / "other.jsonl")[0] == Counter(range(20, 300))
    deadline = time.monotonic() + 6  # removed within 5 s (socket closure is immediate)
    while request(server.socket, "status")[1]["jobs"]:
        assert time.monotonic() < deadline, "the killed job was not removed"
        time.sleep(0.1)
    assert request(server.socket, "status")[1]["pool"]["referenced"] == 0, "its references were kept"
    # Its own workers notice their parent died and remove their transport segments.
    deadline = time.monotonic() + 5
    while any(n.startswith(f"gl-{victim.pid}-") for n in os.listdir("/dev/shm")):
        assert time.monotonic() < deadline, "the killed job's shared memory was left behind"
        time.sleep(0.1)


def test_a_job_may_join_mid_epoch(server, tmp_path):
    first = server.job(tmp_path / "first.jsonl", "--start", "20", "--sleep", "0.05")
    wait_for_rows(tmp_path / "first.jsonl", 5)
    second = server.job(tmp_path / "second.jsonl", "--start", "50", "--stop", "200")
    finish(first)
    finish(second)
    assert epochs(tmp_path / "first.jsonl")[0] == Counter(range(20, 300))
    assert epochs(tmp_path / "second.jsonl")[0] == Counter(range(50, 200))


def test_a_corrupt_sample_fails_only_the_jobs_that_take_it(server, tmp_path):
    bad = server.job(tmp_path / "bad.jsonl", "--start", "0", "--stop", "100")
    skip = server.job(tmp_path / "skip.jsonl", "--start", "0", "--stop", "100", "--on-error", "skip")
    good = server.job(tmp_path / "good.jsonl", "--start", "20", "--stop", "100")
    for proc in (bad, skip, good):
        finish(proc)
    error = lines(tmp_path / "bad.jsonl")[-1]
    assert error["error"] == "TransformError" and "sample 13" in error["message"]
    assert "corrupt JPEG data" in error["message"]
    assert epochs(tmp_path / "skip.jsonl")[0] == Counter(i for i in range(100) if i != 13)
    assert lines(tmp_path / "skip.jsonl")[-1] == {"stats": 1}
    assert epochs(tmp_path / "good.jsonl")[0] == Counter(range(20, 100))


def test_the_pool_stays_within_its_budget_under_pressure(tmp_path):
    # 280 samples of 3 KiB in a 256 KiB pool: most must be evicted and some loaded twice.
    srv = Server(tmp_path / "small.sock", memory="256K")
    try:
        a = srv.job(tmp_path / "a.jsonl", "--start", "20", "--epochs", "2")
        b = srv.job(tmp_path / "b.jsonl", "--start", "20", "--epochs", "2", "--sleep", "0.02")
        for proc in (a, b):
            finish(proc)
        status = request(srv.socket, "status")[1]
        assert status["pool"]["used"] <= status["pool"]["capacity"] == 256 * 1024
        assert status["pool"]["evictions"] > 0
        for name in ("a", "b"):
            assert all(c == Counter(range(20, 300)) for c in epochs(tmp_path / f"{name}.jsonl").values())
    finally:
        srv.stop()


def test_the_server_draws_no_further_ahead_than_its_decoders_can_load(tmp_path):
    """A job asks for a window of 30 samples, but the server draws them only while its decoders
    have room (LOADS_PER_WORKER loads per worker): with one worker, at most that many requests
    wait for a load."""
    srv = Server(tmp_path / "gate.sock", workers=1)
    try:
        proc = srv.job(tmp_path / "a.jsonl", "--start", "20", "--stop", "60", "--slow-decode")
        waiting = []
        while proc.poll() is None:
            status = request(srv.socket, "status")[1]
            if status["jobs"]:
                waiting.append(status["requests"] - status["jobs"][0]["delivered"])
            time.sleep(0.05)
        finish(proc)
        assert epochs(tmp_path / "a.jsonl")[0] == Counter(range(20, 60))
        assert 1 <= max(waiting) <= LOADS_PER_WORKER, waiting
    finally:
        srv.stop()


def test_loads_write_into_space_reserved_ahead_once_the_size_is_known(server, tmp_path):
    """Samples of one size: only the loads sent before the first one finished (LOADS_PER_WORKER each)
    ask the server for space; every later load is sent with its space reserved, even while the
    workers' queues never empty (one load sent without space must not make every later one go
    without: each would cost its worker a round trip to the server)."""
    finish(server.job(tmp_path / "a.jsonl", "--start", "20", "--batch", "20"))
    status = request(server.socket, "status")[1]
    assert status["decodes"] == 280  # the corrupt one is a load too
    assert status["space_requests"] <= LOADS_PER_WORKER * status["workers"], status


def square(record):
    return {"x": np.full(4, record), "index": record}


def test_server_killed_raises_server_gone_or_falls_back_from_the_same_position(tmp_path):
    srv = Server(tmp_path / "k.sock")
    ds = gl.Dataset(gl.from_sequence(list(range(200)))).shuffle(1).map(square, shared=True).batch(10)
    strict = gl.Loader(ds, workers=1, share=True, server=str(srv.socket))
    auto = gl.Loader(ds, workers=1, share="auto", server=str(srv.socket))
    strict_it, auto_it = iter(strict), iter(auto)
    seen = [int(i) for _ in range(3) for i in next(auto_it)["index"]]
    next(strict_it)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait()
    start = time.monotonic()
    with pytest.raises(ServerGoneError):
        for _ in strict_it:
            pass
    assert time.monotonic() - start < 15
    with pytest.warns(UserWarning, match="loading on our own"):
        seen += [int(i) for batch in auto_it for i in batch["index"]]
    assert Counter(seen) == Counter(range(200)), "the fallback lost or repeated samples"
    strict.close()
    auto.close()
    # The dead server's pool and socket are cleaned when the next server starts.
    assert f"gl-pool-{srv.proc.pid}" in pool_segments() and srv.socket.exists()
    again = Server(tmp_path / "k.sock")
    assert f"gl-pool-{srv.proc.pid}" not in pool_segments()
    again.stop()


def test_shared_state_dict_resumes_exactly_what_remains(server):
    ds = gl.Dataset(gl.from_sequence(list(range(120)))).shuffle(2).map(square, shared=True).batch(8)
    with gl.Loader(ds, workers=2, share=True, server=str(server.socket)) as loader:
        it = iter(loader)
        head = [int(i) for _ in range(4) for i in next(it)["index"]]
        state = json.loads(json.dumps(loader.state_dict()))  # it survives a JSON checkpoint
    assert sorted(state["consumed"]) == sorted(head)
    for share in (True, False):  # resumable with or without the server
        with gl.Loader(ds, workers=1, share=share, server=str(server.socket)) as resumed:
            resumed.load_state_dict(state)
            rest = [int(i) for batch in resumed for i in batch["index"]]
        assert Counter(head + rest) == Counter(range(120))


def test_shared_states_of_every_rank_merge_into_another_world(server):
    """Shared mode records each rank's consumed set: the list of every rank's merges, and the new
    world (shared or not) shares out exactly the samples no old rank consumed."""

    def ds(rank: int, world: int) -> gl.Dataset:
        source = gl.from_sequence(list(range(120)))
        return gl.Dataset(source).shuffle(2).map(square, shared=True).shard(rank, world, "none").batch(8)

    seen, states = [], []
    for rank, taken in enumerate([3, 1]):
        with gl.Loader(ds(rank, 2), workers=1, share=True, server=str(server.socket)) as loader:
            it = iter(loader)
            seen += [int(i) for _ in range(taken) for i in next(it)["index"]]
            states.append(json.loads(json.dumps(loader.state_dict())))
    with pytest.raises(StateError, match="load the list of every rank's state"):
        gl.Loader(ds(0, 3)).load_state_dict(states[0])
    for rank in range(3):
        with gl.Loader(ds(rank, 3), workers=1, share=rank == 1, server=str(server.socket)) as resumed:
            resumed.load_state_dict(states)
            seen += [int(i) for batch in resumed for i in batch["index"]]
    assert Counter(seen) == Counter(range(120))


def test_status_command_shows_jobs_pool_and_savings(server, tmp_path):
    job = server.job(tmp_path / "slow.jsonl", "--start", "20", "--sleep", "0.3")
    wait_for_rows(tmp_path / "slow.jsonl", 1)
    out = subprocess.run(
        [sys.executable, "-m", "globalloader.cli", "status", "--once", "--socket", str(server.socket)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    job.kill()
    job.wait()
    assert "job.py" in out and "280" in out and "decodes saved" in out and "MiB" in out


def test_a_pool_smaller_than_the_jobs_windows_still_serves_them_and_one_too_small_says_so(tmp_path):
    # 13 samples of 3 KiB fit: enough for a batch of 10 but not for the prefetch windows.
    srv = Server(tmp_path / "tiny.sock", memory="40K", workers=1)
    try:
        fits = srv.job(tmp_path / "fits.jsonl", "--start", "20", "--batch", "10")
        finish(fits)
        assert epochs(tmp_path / "fits.jsonl")[0] == Counter(range(20, 300))
        too_big = srv.job(tmp_path / "big.jsonl", "--start", "20", "--batch", "14")
        finish(too_big)
        error = lines(tmp_path / "big.jsonl")[-1]
        assert error["error"] == "PoolTooSmallError" and "--memory" in error["message"]
    finally:
        srv.stop()


def block(record):
    return {"x": np.full(1024, record, dtype=np.int64)}  # 8 KiB


def test_unbatched_samples_read_in_place_outlive_their_pool_space(tmp_path):
    # 200 samples of 8 KiB through a 256 KiB pool: space is reused many times over while the
    # consumer still holds every sample it was given, so each must have been copied out.
    srv = Server(tmp_path / "reuse.sock", memory="256K", workers=1)
    try:
        ds = gl.Dataset(gl.from_sequence(list(range(200)))).shuffle(3).map(block, shared=True)
        with gl.Loader(ds, workers=0, share=True, server=str(srv.socket)) as loader:
            held = list(loader)
        assert sorted(int(s["x"][0]) for s in held) == list(range(200))
        assert all((s["x"] == s["x"][0]).all() for s in held), "a held sample was overwritten"
        assert request(srv.socket, "status")[1]["pool"]["evictions"] > 0
    finally:
        srv.stop()

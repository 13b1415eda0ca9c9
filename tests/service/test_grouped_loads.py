"""Decode workers take loads two per message and answer them together: attacks on that.

Real servers, real decode workers killed by real signals. Each test checks what a job sees: every
sample of an epoch exactly once, or a named error
naming the sample at fault; never a hang, a lost or a duplicated sample.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader import errors
from helpers import Server, pool_segments

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]

N = 40
_LOADED: list[int] = []  # in a decode worker: the samples it was given, in order


def values(record):
    return {"x": np.full(256, record, np.int64), "index": record}


def _nth_load_of_this_worker(record) -> int:
    _LOADED.append(record)
    return len(_LOADED)


def _first(flag: str, record) -> bool:
    """Whether this is the first time any worker got here: creates `flag` holding `record`, at
    most once over all workers (they run at once: a check then a write would let two through)."""
    try:
        fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(str(record))
    return True


def dies_at_second_load_once(flag: str, record):
    """Kills its decode worker at the second load it gets (the first of its group is finished and
    its outcome held), the first time only: the retry in the replacement succeeds."""
    if _nth_load_of_this_worker(record) == 2 and _first(flag, record):
        os.kill(os.getpid(), signal.SIGKILL)
    return values(record)


def hangs_at_nth_load_once(flag: str, nth: int, record):
    """Hangs at the nth load its decode worker gets, the first time only (1: the first of a group,
    its pair queued behind it; 2: the second, its pair finished)."""
    if _nth_load_of_this_worker(record) == nth and _first(flag, record):
        time.sleep(3600)
    return values(record)


def raises_at(bad: int, record):
    if record == bad:
        raise ValueError(f"bad record {record}")
    return values(record)


def big_at(big: int, record):
    size = 64 * 1024 if record == big else 256  # 512 KiB: far past the guessed size
    return {"x": np.full(size, record, np.int64), "index": record}


def chain(fn, n: int = N, batch: int | None = 4, seed: int = 0) -> gl.Dataset:
    ds = gl.Dataset(gl.from_sequence(list(range(n)))).shuffle(seed=seed).map(fn, shared=True)
    return ds.batch(batch) if batch else ds


def indices(batches) -> list[int]:
    return [int(i) for b in batches for i in np.atleast_1d(b["index"])]


def local_order(n: int = N, batch: int | None = 4, seed: int = 0) -> list[int]:
    """The job's order without a server: the samples a shared epoch must deliver (its order is
    the joint sampler's, uniform but not reproducible, docs/shared.md)."""
    with gl.Loader(chain(values, n, batch, seed)) as loader:
        return indices(loader)


def once(seen: list[int], expected: list[int]) -> None:
    assert Counter(seen) == Counter(expected), (
        f"lost {sorted(set(expected) - set(seen))}, repeated {sorted(k for k, c in Counter(seen).items() if c > 1)}"
    )


@pytest.fixture(params=[1, 2], ids=["1worker", "2workers"])
def srv(tmp_path: Path, request):
    server = Server(tmp_path / "g.sock", memory="8M", workers=request.param)
    yield server
    server.stop()
    assert not server.socket.exists() and f"gl-pool-{server.proc.pid}" not in pool_segments()


def test_a_worker_killed_holding_a_finished_outcome_loses_and_repeats_nothing(srv, tmp_path):
    flag = tmp_path / "flag"
    fn = functools.partial(dies_at_second_load_once, str(flag))
    with gl.Loader(chain(fn), share=True, server=str(srv.socket), on_error="skip") as loader:
        seen = indices(loader)
        assert loader.stats()["skipped"] == 0
    assert flag.exists(), "no worker was killed: the test tested nothing"
    once(seen, local_order())


@pytest.mark.parametrize("nth", [1, 2], ids=["first_of_group", "second_of_group"])
def test_a_hang_names_its_own_sample_and_its_pair_is_still_delivered(srv, tmp_path, nth):
    flag = tmp_path / "flag"
    fn = functools.partial(hangs_at_nth_load_once, str(flag), nth)
    seen: list[int] = []
    with gl.Loader(chain(fn, batch=None), share=True, server=str(srv.socket), timeout=3) as loader:
        it = iter(loader)

        def take() -> None:  # the samples before the error count too
            seen.extend(int(sample["index"]) for sample in it)

        with pytest.raises(errors.LoaderTimeoutError) as caught:
            take()
        hung = int(flag.read_text())
        assert f"sample {hung}:" in str(caught.value)
        assert hung not in seen
        seen += indices(loader)  # iterating again goes on, the failed sample retried (it hangs once)
    once(seen, local_order(batch=None))


@pytest.mark.parametrize("position", range(4))
def test_a_sample_error_in_a_group_skips_only_that_sample(srv, position):
    order = local_order()
    bad = order[position * 7]  # anywhere in a group, first or second in it
    with gl.Loader(chain(functools.partial(raises_at, bad)), share=True, server=str(srv.socket), on_error="skip") as ld:
        seen = indices(ld)
        assert ld.stats()["skipped"] == 1
    once(seen, [i for i in order if i != bad])


@pytest.mark.parametrize("position", range(3))
def test_a_sample_larger_than_its_guess_inside_a_group_unbatched(srv, position):
    order = local_order(batch=None)
    big = order[position * 7]
    with gl.Loader(chain(functools.partial(big_at, big), batch=None), share=True, server=str(srv.socket)) as loader:
        got = list(loader)
    once([int(s["index"]) for s in got], order)
    for s in got:
        i = int(s["index"])
        assert s["x"].size == (64 * 1024 if i == big else 256) and (s["x"] == i).all()


def test_exact_resume_through_the_server_after_a_killed_worker(srv, tmp_path):
    flag = tmp_path / "flag"
    fn = functools.partial(dies_at_second_load_once, str(flag))
    ds = chain(fn, n=80)
    with gl.Loader(ds, workers=1, share=True, server=str(srv.socket)) as loader:
        it = iter(loader)
        head = indices(next(it) for _ in range(5))
        state = json.loads(json.dumps(loader.state_dict()))
    with gl.Loader(ds, workers=1, share=True, server=str(srv.socket)) as resumed:
        resumed.load_state_dict(state)
        rest = indices(resumed)
    assert flag.exists()
    once(head + rest, local_order(n=80))


def slow_values(record):
    time.sleep(0.02)
    return values(record)


@pytest.mark.slow
def test_a_job_that_leaves_with_loads_held_does_not_hurt_the_others(srv, tmp_path):
    """Three jobs at once on other orders; one leaves after two batches while its loads are in the
    workers, one has a worker killed under it: the others still get their exact epochs."""
    flag = tmp_path / "flag"
    fn = functools.partial(dies_at_second_load_once, str(flag))
    leaving = gl.Loader(chain(slow_values, n=200, seed=1), share=True, server=str(srv.socket))
    it = iter(leaving)
    next(it), next(it)
    with (
        gl.Loader(chain(fn, n=120, seed=2), share=True, server=str(srv.socket)) as a,
        gl.Loader(chain(values, n=120, seed=3), share=True, server=str(srv.socket)) as b,
    ):
        ia, ib = iter(a), iter(b)
        got_a, got_b = indices([next(ia)]), indices([next(ib)])
        leaving.close()  # its loads are queued or held in the decode workers now
        got_a += indices(ia)
        got_b += indices(ib)
    once(got_a, local_order(120, seed=2))
    once(got_b, local_order(120, seed=3))
    with gl.Loader(chain(values), share=True, server=str(srv.socket)) as again:
        once(indices(again), local_order())


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_job_killed_while_its_loads_are_held_leaves_the_job_sharing_them_whole(srv, tmp_path):
    """Two job processes on the same shared prefix (their loads are the same loads); one is
    SIGKILLed after its first batch, its loads queued and held in the decode workers: the other
    still gets every sample once, and the server's pool is all released afterwards."""
    from globalloader.service.launcher import status

    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    args = ("--start", "14", "--stop", "104", "--slow-decode", "--batch", "6")
    victim, survivor = (srv.job(out, *args) for out in outs)
    try:
        deadline = time.monotonic() + 60
        while not _lines(outs[0]):
            assert victim.poll() is None and time.monotonic() < deadline, victim.stdout.read()
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        assert survivor.wait(timeout=120) == 0, survivor.stdout.read()
    finally:
        for p in (victim, survivor):
            if p.poll() is None:
                p.kill()
            p.wait()
    lines = _lines(outs[1])
    assert "error" not in lines[-1], lines[-1]
    once([i for line in lines for i in line.get("indices", [])], list(range(14, 104)))
    deadline = time.monotonic() + 10
    while status(srv.socket)["pool"]["referenced"]:
        assert time.monotonic() < deadline, "the killed job's references were never released"
        time.sleep(0.1)
    with gl.Loader(chain(values), share=True, server=str(srv.socket)) as again:
        once(indices(again), local_order())


def slow_first_once(flag: str, record):
    """Sample 0 runs 4 s the first time: long, but well within its job's timeout."""
    if record == 0 and _first(flag, record):
        time.sleep(4)
    return values(record)


def values_b(record):
    return {"x": np.full(256, record, np.int64), "index": record, "job": 1}  # another prefix


def test_a_load_queued_behind_another_jobs_long_load_is_not_blamed_for_it(tmp_path):
    """One decode worker; job A (timeout 60 s) has a load running 4 s, job B (timeout 2 s) has
    its loads queued behind it in the same worker. B's loads never ran, so they cannot have run
    past B's timeout: the worker is not killed, no B sample is named, and both get every sample.
    (It was: B's queued sample was failed as 'the shared prefix ran for more than 2 s on it' and
    A's running load was killed and retried.)"""
    from globalloader.service.launcher import status

    server = Server(tmp_path / "q.sock", memory="8M", workers=1)
    try:
        flag = tmp_path / "flag"
        a_ds = gl.Dataset(gl.from_sequence([0, 1])).map(functools.partial(slow_first_once, str(flag)), shared=True)
        b_ds = gl.Dataset(gl.from_sequence(list(range(10)))).map(values_b, shared=True)
        a_seen: list[int] = []
        with gl.Loader(a_ds, share=True, server=str(server.socket), timeout=60) as a:
            ia = iter(a)
            reader = threading.Thread(target=lambda: a_seen.extend(int(s["index"]) for s in ia))
            reader.start()
            deadline = time.monotonic() + 30
            while not flag.exists():  # A's sample 0 is running, its sample 1 queued behind it
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with gl.Loader(b_ds, share=True, server=str(server.socket), timeout=2) as b:
                b_seen = [int(s["index"]) for s in b]
            reader.join(timeout=60)
        once(a_seen, [0, 1])
        once(b_seen, list(range(10)))
        assert status(server.socket)["worker_restarts"] == 0
    finally:
        server.stop()


def hangs_holding_the_gil_at_second_load_once(flag: str, record):
    """As `hangs_at_nth_load_once(2)`, but the hang is a C call that keeps the GIL (a native
    decoder stuck without releasing it): the thread that sends held outcomes cannot run."""
    if _nth_load_of_this_worker(record) == 2 and _first(flag, record):
        ctypes.PyDLL(None).sleep(3600)
    return values(record)


def test_a_hang_holding_the_gil_names_its_own_sample(tmp_path):
    server = Server(tmp_path / "h.sock", memory="8M", workers=1)
    try:
        flag = tmp_path / "flag"
        fn = functools.partial(hangs_holding_the_gil_at_second_load_once, str(flag))
        with gl.Loader(chain(fn, batch=None), share=True, server=str(server.socket), timeout=3) as loader:
            with pytest.raises(errors.LoaderTimeoutError) as caught:
                list(loader)
            assert f"sample {int(flag.read_text())}:" in str(caught.value)
    finally:
        server.stop()


def kills_its_first_three_loads(folder: str, bad: int, record):
    """Sample `bad` kills its decode worker the first three times it is loaded (as many as a
    load may kill before it fails), then loads: a retry after the error succeeds."""
    if record == bad:
        for k in range(3):
            if _first(f"{folder}/kill-{k}", record):
                os.kill(os.getpid(), signal.SIGKILL)
    return values(record)


def test_only_the_sample_that_kills_its_worker_is_named_not_the_ones_queued_behind_it(srv, tmp_path):
    # The loads queued behind the killer die with its worker each time; they must not count
    # those deaths as their own, or after three they would fail in its place.
    bad = 5
    fn = functools.partial(kills_its_first_three_loads, str(tmp_path), bad)
    named: list[str] = []
    seen: list[int] = []
    with gl.Loader(chain(fn, batch=None), share=True, server=str(srv.socket), timeout=60) as loader:
        for _ in range(4):
            try:
                seen.extend(int(sample["index"]) for sample in loader)  # goes on after an error
                break
            except errors.WorkerError as exc:
                named.append(str(exc).split("sample ", 1)[1].split(":", 1)[0])
    assert named == [str(bad)]
    once(seen, local_order(batch=None))

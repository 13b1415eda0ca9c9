"""runtime.WorkerPool with real processes: death, timeout, shared memory, stop, parent death."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from globalloader._pids import alive
from globalloader.errors import LoaderTimeoutError, WorkerError
from globalloader.runtime.pool import INLINE_BYTES, Worker, WorkerPool
from globalloader.transport.names import ORPHAN_AGE_S, SHM_DIR, list_names, remove_leftovers, remove_orphans

pytestmark = pytest.mark.timeout(60)
FORK = mp.get_context("fork")


class Echo:
    """A test body: answers, sleeps, writes batches or kills itself, as told."""

    def setup(self, worker: Worker) -> None:
        self.index = worker.index

    def run(self, worker: Worker, message: tuple) -> None:
        op, arg = message
        if op == "echo":
            worker.send((self.index, os.getpid(), arg))
        elif op == "sleep":
            time.sleep(arg)
            worker.send("slept")
        elif op == "batch":  # a batch of `arg` bytes, and how many segments this worker holds
            worker.send((worker.pack(np.full(arg, 7, np.uint8)), worker.writer.segment_count))
        elif op == "kill":
            if arg == "leave a child" and os.fork() == 0:  # it holds this worker's pipe open
                time.sleep(10)
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def pool():
    pools: list[WorkerPool] = []

    def make(n: int = 1, timeout: float = 30.0) -> WorkerPool:
        pools.append(WorkerPool(Echo(), n, FORK, timeout, name="test worker"))
        return pools[-1]

    yield make
    for p in pools:
        p.close(grace=1.0)


def test_replies_come_from_each_worker_in_order(pool):
    p = pool(2)
    for w in (0, 1):
        p.send(w, ("echo", f"a{w}"))
        p.send(w, ("echo", f"b{w}"))
    assert [p.receive(1)[2], p.receive(1)[2], p.receive(0)[2], p.receive(0)[2]] == ["a1", "b1", "a0", "b0"]
    p.send(0, ("echo", "c"))
    assert p.receive_any()[0] == 0


def test_a_worker_killed_mid_task_is_one_error_naming_its_pid_and_signal(pool):
    p = pool(2, timeout=30.0)
    pid = p.procs[1].pid
    p.send(1, ("kill", None))
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"test worker \(pid {pid}\) is killed by signal: .*SIGKILL.* task 9"):
        p.receive(1, " while running task 9")
    assert time.monotonic() - start < 5  # noticed through the sentinel, not the 30 s timeout
    p.send(0, ("echo", 1))  # its sibling is unaffected
    assert p.receive(0)[2] == 1


def test_a_death_is_noticed_while_a_child_of_the_worker_holds_its_pipe(pool):
    """No end of file comes while the dataset's own child process holds the pipe: the sentinel tells."""
    p = pool(1, timeout=30.0)
    pid = p.procs[0].pid
    p.send(0, ("kill", "leave a child"))
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"\(pid {pid}\) is killed by signal"):
        p.receive(0)
    assert time.monotonic() - start < 5


def test_a_death_is_noticed_by_receive_any_too(pool):
    p = pool(2)
    pid = p.procs[0].pid
    p.send(0, ("kill", None))
    with pytest.raises(WorkerError, match=rf"\(pid {pid}\) is killed by signal"):
        p.receive_any()


def test_waiting_on_workers_all_told_to_stop_is_an_error_not_a_hang(pool):
    p = pool(2, timeout=0)  # 0: no deadline of its own
    p.stop(0)
    p.stop(1)
    with pytest.raises(WorkerError, match="every worker was told to stop"):
        p.receive_any()


def test_a_hung_worker_is_a_timeout_error(pool):
    p = pool(1, timeout=0.5)
    p.send(0, ("sleep", 30))
    start = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match=r"timed out after 0.5 seconds while running task 2; raise timeout="):
        p.receive(0, " while running task 2")
    assert time.monotonic() - start < 5
    assert isinstance(LoaderTimeoutError("x"), RuntimeError)  # what torch's DataLoader raises on a timeout


def test_segments_go_back_to_their_writer_and_are_reused(pool):
    p = pool(1)
    held = []
    for _ in range(6):
        p.send(0, ("batch", 2 * INLINE_BYTES))
        packed, count = p.receive(0)
        batch = p.unpack(0, packed)
        assert batch.nbytes == 2 * INLINE_BYTES and (batch == 7).all()
        held.append(count)
        del batch
        gc.collect()
    assert held[-1] == 1  # one segment, released and handed back with each next message
    p.send(0, ("batch", 16))  # small: inline, no segment
    packed, _ = p.receive(0)
    assert packed[1] is None and p.unpack(0, packed).tolist() == [7] * 16


def test_a_discarded_batch_frees_its_segment(pool):
    p = pool(1)
    for _ in range(3):
        p.send(0, ("batch", 2 * INLINE_BYTES))
        packed, count = p.receive(0)
        p.discard(0, packed)
    assert count == 1


def test_close_stops_idle_workers_politely_and_kills_a_busy_one(pool):
    p = pool(2)
    p.send(1, ("batch", 2 * INLINE_BYTES))
    p.receive(1)  # a segment nobody will read
    p.send(0, ("sleep", 60))
    time.sleep(0.2)
    start = time.monotonic()
    p.close(grace=1.0)
    assert time.monotonic() - start < 5
    assert p.procs[0].exitcode == -signal.SIGKILL and p.procs[1].exitcode == 0
    assert list_names(p.prefix) == []


def test_a_restarted_worker_is_a_new_process_in_the_same_place(pool):
    p = pool(1)
    p.send(0, ("sleep", 60))
    old = p.procs[0].pid
    p.restart(0)
    p.send(0, ("echo", "again"))
    index, pid, arg = p.receive(0)
    assert (index, arg) == (0, "again") and pid != old and not alive(old)


def test_workers_exit_when_their_owner_is_killed(tmp_path):
    """Even a worker stuck in a task exits, and unlinks the segments it wrote that nobody read."""
    code = f"""
        import multiprocessing as mp, os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_worker_pool import Echo
        from globalloader.runtime.pool import INLINE_BYTES, WorkerPool
        pool = WorkerPool(Echo(), 2, mp.get_context("fork"), 30.0)
        pool.send(0, ("batch", 2 * INLINE_BYTES))
        pool.receive(0)  # written, never read
        pool.send(1, ("sleep", 600))  # busy
        print(pool.prefix, *(p.pid for p in pool.procs), flush=True)
        time.sleep(600)
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        prefix, *pids = owner.stdout.readline().split()
        assert len(pids) == 2 and list_names(prefix)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 5
        while any(alive(int(pid)) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(int(pid)) for pid in pids)
        assert list_names(prefix) == []
    finally:
        owner.kill()
        owner.wait()


def _shm_age(names: list[str], seconds: float) -> None:
    """Make `names` look last written `seconds` ago."""
    then = time.time() - seconds
    for name in names:
        os.utime(os.path.join(SHM_DIR, name), (then, then))


def test_a_new_pool_removes_what_a_job_killed_whole_left_in_shared_memory(pool):
    """SIGKILL of a job's process group kills its workers too, so no watchdog unlinks their unread
    batches: the next pool on the machine does, once they are ORPHAN_AGE_S old, and touches
    neither a younger orphan nor the segments of a live owner."""
    code = f"""
        import multiprocessing as mp, os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_worker_pool import Echo
        from globalloader.runtime.pool import INLINE_BYTES, WorkerPool
        pool = WorkerPool(Echo(), 2, mp.get_context("fork"), 30.0)
        for w in range(2):
            pool.send(w, ("batch", 2 * INLINE_BYTES))
            pool.receive(w)  # written, never read
        print(pool.prefix, *(p.pid for p in pool.procs), flush=True)
        time.sleep(600)
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        prefix, *pids = job.stdout.readline().split()
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + 5
        while any(alive(int(pid)) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = list_names(prefix)
        assert len(left) == 2  # the kill left them: nobody was there to unlink them
        live = pool(1)  # a live owner's unread batch, made old: never an orphan
        live.send(0, ("batch", 2 * INLINE_BYTES))
        live.receive(0)
        mine = list_names(live.prefix)
        _shm_age(mine, 10 * ORPHAN_AGE_S)
        _shm_age(left[:1], ORPHAN_AGE_S / 2)  # too young to be sure
        _shm_age(left[1:], 2 * ORPHAN_AGE_S)
        pool(1)
        assert list_names(prefix) == left[:1] and list_names(live.prefix) == mine
        assert remove_orphans() == 0
        _shm_age(left[:1], 2 * ORPHAN_AGE_S)
        assert remove_orphans() == 1 and list_names(prefix) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        if "prefix" in locals():
            remove_leftovers(prefix)

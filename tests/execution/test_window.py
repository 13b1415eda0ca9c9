"""The task window over real worker threads: round-robin placement, the in-flight bound, task
order whatever order the workers finish in, retired workers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import LoaderTimeoutError
from globalloader.execution.window import TaskWindow
from globalloader.execution.workers import Task, ThreadWorkers

WORKERS = 3


def tagged(x: int) -> dict:
    """The sample with the thread that computed it; task 0's worker is the slowest, so later tasks
    finish first."""
    if x < 2:
        time.sleep(0.2)
    return {"x": x, "thread": threading.current_thread().name}


def plan(n: int = 24):
    return gl.Dataset(gl.from_sequence(list(range(n)))).map(tagged).batch(2).plan


@pytest.fixture
def workers():
    threads = ThreadWorkers(plan(), False, WORKERS, timeout=30)
    yield threads
    threads.close()


def test_tasks_go_round_robin_from_the_first_task_and_come_back_in_task_order(workers):
    window: TaskWindow[Task] = TaskWindow(workers, WORKERS, depth=4, first=5)
    placed = [window.submit(Task(0, t, None)) for t in range(5, 9)]
    assert placed == [t % WORKERS for t in range(5, 9)]
    collected = [window.collect() for _ in range(4)]
    assert [task.number for task, _, _ in collected] == [5, 6, 7, 8]
    for task, worker, result in collected:
        assert result.number == task.number
        assert set(result.output["thread"]) == {f"globalloader-{worker}"}
    assert len(window) == 0


def test_the_window_is_full_at_its_depth_and_drains_to_empty(workers):
    window: TaskWindow[Task] = TaskWindow(workers, WORKERS, depth=2)
    window.submit(Task(0, 0, None))
    assert not window.full()
    window.submit(Task(0, 1, None))
    assert window.full() and len(window) == 2
    window.drain()
    assert len(window) == 0 and not window.full()


def test_a_retired_worker_gets_no_more_tasks_and_its_tasks_are_not_waited_for(workers):
    window: TaskWindow[Task] = TaskWindow(workers, WORKERS, depth=6)
    for t in range(6):
        window.submit(Task(0, t, None))
    window.retire(1)  # tasks 1 and 4 will never be collected
    assert len(window) == 4
    assert [window.collect()[0].number for _ in range(4)] == [0, 2, 3, 5]
    assert len(window) == 0
    assert [window.submit(Task(0, t, None)) for t in (6, 7, 8)] == [0, 2, 0]
    window.retire(0)
    window.retire(2)
    assert window.submit(Task(0, 9, None)) is None  # every worker retired: nothing sent
    window.drain()


def test_a_worker_past_the_timeout_is_the_loaders_timeout_error():
    threads = ThreadWorkers(plan(), False, 1, timeout=0.05)
    try:
        window: TaskWindow[Task] = TaskWindow(threads, 1, depth=1)
        window.submit(Task(0, 0, None))  # its samples sleep past the timeout
        with pytest.raises(LoaderTimeoutError, match=r"worker thread 0 produced nothing .*\(Loader\(timeout=\)\)"):
            window.collect()
    finally:
        threads.close()


def test_a_resumed_pass_runs_each_task_on_the_worker_an_unbroken_pass_would():
    ds = gl.Dataset(gl.from_sequence(list(range(24)))).map(tagged).batch(2)
    with gl.Loader(ds, workers=WORKERS, mode="thread") as loader:
        whole = [(b["x"].tolist(), list(b["thread"])) for b in loader]
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
    with gl.Loader(ds, workers=WORKERS, mode="thread") as resumed:
        resumed.load_state_dict(state)
        rest = [(b["x"].tolist(), list(b["thread"])) for b in resumed]
    assert rest == whole[4:]
    assert np.array_equal([int(t[0][-1]) for _, t in whole], [t % WORKERS for t in range(12)])

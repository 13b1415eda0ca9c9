from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, TransformError, WorkerError
from helpers import check_resume, same


def records(n: int) -> list[dict]:
    return [{"__key__": f"s{i}", "pixels": np.full((8, 8, 3), i % 256, np.uint8), "label": i} for i in range(n)]


def augment(r, rng):
    return {**r, "pixels": (r["pixels"] + rng.integers(0, 3, size=r["pixels"].shape)).astype(np.float32)}


def chain(n: int = 100, batch: int | None = 8):
    ds = gl.Dataset(records(n)).shuffle(seed=4).map(augment)
    return ds.batch(batch) if batch else ds


def whole_epoch(loader: gl.Loader) -> list:
    with loader:
        return list(loader)


@pytest.mark.parametrize("batch", [8, None])
def test_same_output_for_any_worker_count_and_mode(batch):
    reference = list(chain(batch=batch))
    for mode in ("process", "thread"):
        for workers in (0, 1, 3):
            out = whole_epoch(gl.Loader(chain(batch=batch), workers=workers, mode=mode, prefetch=4))
            assert same(out, reference), f"mode={mode} workers={workers}"


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("at", [0, 1, 5, 12])
def test_resume_mid_epoch_whatever_was_prefetched(mode, at):
    check_resume(lambda: gl.Loader(chain(), workers=2, mode=mode, prefetch=6), at)


def test_resume_mid_task_when_unbatched():
    # 100 samples come in tasks of 32: stopping at 45 stops inside the second task.
    check_resume(lambda: gl.Loader(chain(batch=None), workers=2, prefetch=2), 45)


def test_state_dict_after_load_and_before_iteration_is_the_loaded_one():
    with gl.Loader(chain(), workers=1) as loader:
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
    with gl.Loader(chain(), workers=1) as other:
        other.load_state_dict(state)
        assert other.state_dict() == state
        other.set_epoch(state["epoch"])  # the usual loop calls set_epoch: it must keep the position
        assert len(list(other)) == len(chain()) - 2


def test_epochs_differ_and_a_finished_epoch_advances():
    with gl.Loader(chain(batch=None), workers=2) as loader:
        first = [r["__key__"] for r in loader]
        assert loader.state_dict()["epoch"] == 1
        second = [r["__key__"] for r in loader]
        loader.set_epoch(0)
        again = [r["__key__"] for r in loader]
    assert sorted(first) == sorted(second) and first != second and again == first


def pid(r):
    return {"pid": os.getpid()}


def test_workers_start_once_and_live_across_epochs():
    ds = gl.Dataset(records(40)).map(pid).batch(4)
    with gl.Loader(ds, workers=2) as loader:
        epochs = [{int(p) for b in loader for p in b["pid"]} for _ in range(3)]
    assert len(epochs[0]) == 2 and epochs[0] == epochs[1] == epochs[2]
    assert os.getpid() not in epochs[0]


def kill_on_17(r):
    if r["label"] == 17:
        os.kill(os.getpid(), signal.SIGKILL)
    return r


@pytest.mark.timeout(60)
def test_a_killed_worker_is_an_error_not_a_hang():
    ds = gl.Dataset(records(40)).map(kill_on_17).batch(4)
    with gl.Loader(ds, workers=2) as loader:
        with pytest.raises(WorkerError, match=r"SIGKILL.*task 4"):
            list(loader)
        # The loader recovers: a new iteration starts fresh workers from where it stopped.
        loader.load_state_dict({**loader.state_dict(), "task": 5})
        assert len(list(loader)) == 5


def fail_on_3(r):
    if r["label"] == 3:
        raise ValueError("bad pixels")
    return r


def test_an_error_in_a_worker_names_the_map_and_sample_and_keeps_the_traceback():
    ds = gl.Dataset(records(10)).map(fail_on_3).batch(2)
    with (
        gl.Loader(ds, workers=2) as loader,
        pytest.raises(TransformError, match=r"map 'fail_on_3' failed on sample index 3 \(key 's3'\)") as info,
    ):
        list(loader)
    assert "bad pixels" in str(info.value.__cause__)


def test_skip_drops_bad_samples_counts_them_and_warns():
    ds = gl.Dataset(records(10)).map(fail_on_3).batch(4)
    with gl.Loader(ds, workers=2, on_error="skip") as loader:
        with pytest.warns(UserWarning, match="skipped 1 bad sample.*index 3.*bad pixels"):
            batches = list(loader)
        assert loader.stats()["skipped"] == 1
    labels = sorted(int(x) for b in batches for x in b["label"])
    assert labels == [0, 1, 2, 4, 5, 6, 7, 8, 9]


# What each value is made by, and what pickle says of it
UNSENDABLE = {
    "lambda": (lambda: lambda: 0, "AttributeError: Can't pickle local object"),
    "lock": (threading.Lock, "TypeError: cannot pickle '_thread.lock'"),
}


def unsendable_on_3(make):
    def unsendable_on_3(r):
        return {**r, "extra": make() if r["label"] == 3 else 0}

    return unsendable_on_3


@pytest.mark.parametrize("value", sorted(UNSENDABLE))
@pytest.mark.parametrize("batch", [4, None])
def test_a_map_returning_what_cannot_be_pickled_names_the_map_and_the_sample(value: str, batch: int | None):
    make, cause = UNSENDABLE[value]
    ds = gl.Dataset(records(10)).map(unsendable_on_3(make))
    ds = ds.batch(batch) if batch else ds
    with (
        gl.Loader(ds, workers=2) as loader,
        pytest.raises(
            TransformError,
            match=rf"map 'unsendable_on_3' returned, for sample index 3 \(key 's3'\), a value a worker process "
            rf"cannot send: {cause}",
        ),
    ):
        list(loader)


def test_skip_drops_a_sample_that_cannot_be_pickled_and_keeps_the_rest_whole():
    """An unpicklable value is its sample's own map's fault: skipped like an exception, in a batch
    large enough for shared memory (whose segment the failed reply gives back), epoch after epoch."""
    big = [{"__key__": f"s{i}", "pixels": np.full((256, 256, 3), i, np.uint8), "label": i} for i in range(12)]
    ds = gl.Dataset(big).map(unsendable_on_3(threading.Lock)).batch(4)
    with gl.Loader(ds, workers=2, on_error="skip") as loader:
        for epoch in range(2):
            with pytest.warns(UserWarning, match="skipped 1 bad sample.*index 3.*cannot send"):
                batches = list(loader)
            assert loader.stats()["skipped"] == epoch + 1
            labels = [int(x) for b in batches for x in b["label"]]
            assert labels == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
            assert all((b["pixels"] == b["label"][:, None, None, None]).all() for b in batches)
            assert shm_names() == set(), "the failed batch's segment was not given back to be reused"
    assert shm_names() == set()


def stream_records():
    return ({"__key__": f"s{i}", "label": i} for i in range(10))


def lock_on_3_in_place(r):
    r["label"] *= 10  # in place: running the map twice on a stream's record would be wrong
    if r["label"] == 30:
        r["lock"] = threading.Lock()
    return r


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_stream_record_that_cannot_be_pickled_is_named_and_not_run_twice_to_skip_it(on_error: str):
    ds = gl.Dataset.stream(stream_records).map(lock_on_3_in_place)
    with (
        gl.Loader(ds, workers=2, on_error=on_error) as loader,
        pytest.raises(
            TransformError,
            match=r"the stream's records through the maps 'lock_on_3_in_place' returned, for task 0 of epoch 0, a "
            r"value a worker process cannot send: TypeError: cannot pickle '_thread.lock'",
        ),
    ):
        list(loader)


def lock_in_batch(batch):
    return {**batch, "lock": threading.Lock()}


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_batch_map_returning_what_cannot_be_pickled_is_named(on_error: str):
    ds = gl.Dataset(records(8)).batch(4).map(lock_in_batch)
    with (
        gl.Loader(ds, workers=2, on_error=on_error) as loader,
        pytest.raises(TransformError, match=r"map 'lock_in_batch' returned, for batch 0 of epoch 0, a value"),
    ):
        list(loader)


def test_stats_name_every_stage():
    with gl.Loader(chain(), workers=2) as loader:
        n = len(list(loader))
        stats = loader.stats()
    assert stats["stages"]["read"]["items"] == 100
    assert stats["stages"]["augment"]["items"] == 100
    assert stats["stages"]["collate"]["items"] == n == stats["consumer"]["items"]
    assert stats["stages"]["transport"]["items"] == n
    assert stats["workers"]["busy_s"] > 0 and stats["consumer"]["wait_s"] >= 0


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"gl-{os.getpid()}-")}


def test_batches_stay_valid_after_close_and_no_shared_memory_is_left():
    loader = gl.Loader(chain(), workers=2)
    held = list(loader)
    loader.close()
    assert same(held, list(chain()))
    assert shm_names() == set()


def test_argument_errors_name_the_argument():
    with pytest.raises(ArgumentError, match="workers"):
        gl.Loader(chain(), workers=-1)
    with pytest.raises(ArgumentError, match="mode"):
        gl.Loader(chain(), mode="fiber")
    with pytest.raises(ArgumentError, match="on_error"):
        gl.Loader(chain(), on_error="ignore")
    with pytest.raises(ArgumentError, match="dataset"):
        gl.Loader([1, 2, 3])


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("timeout", float("nan")),
        ("timeout", float("inf")),
        ("timeout", 0),
        ("timeout", True),
        ("timeout", "10"),
        ("workers", True),
        ("workers", 1.0),
        ("workers", np.bool_(True)),
        ("workers", np.int64(-1)),
        ("timeout", np.float32("nan")),
        ("timeout", 1e300),  # a thread's wait raised OverflowError
        ("prefetch", True),
        ("prefetch", 0),
        ("start_method", "thread"),
        ("share", 1),
        ("share", "yes"),
        ("server", 3),
        ("name", 3),
    ],
)
def test_every_argument_is_checked_where_it_enters(argument, value):
    with pytest.raises(ArgumentError, match=rf"Loader: {argument} must be"):
        gl.Loader(chain(), **{argument: value})


def test_numpy_numbers_are_taken_as_the_plain_numbers_they_hold():
    """np.int64(2) workers is what a user computing counts with NumPy means; kept as an int, so
    states stay plain JSON."""
    loader = gl.Loader(chain(), workers=np.int64(2), prefetch=np.int32(3), timeout=np.float32(30))
    assert (type(loader.workers), type(loader.prefetch), type(loader.timeout)) == (int, int, float)
    loader.set_epoch(np.int64(1))
    with loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state and state["epoch"] == 1


def test_spawned_workers_receive_lambdas_through_cloudpickle():
    ds = gl.Dataset(records(12)).map(lambda r: {**r, "label": r["label"] * 10}).batch(4)
    out = whole_epoch(gl.Loader(ds, workers=1, start_method="spawn"))
    assert [int(x) for b in out for x in b["label"]] == [i * 10 for i in range(12)]


def test_a_consumer_that_handles_sigterm_still_exits_with_workers_running(tmp_path):
    """Lightning installs a SIGTERM handler that logs and goes on; forked workers inherit it, and
    multiprocessing ends daemonic workers at exit with SIGTERM and waits for them: a worker must
    reset it, or the training script never exits."""
    script = tmp_path / "consumer.py"
    script.write_text(
        "import signal\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('SIGTERM ignored', flush=True))\n"
        "import globalloader as gl\n"
        "loader = gl.Loader(gl.Dataset(list(range(480))).shuffle(0).batch(8), workers=2)\n"
        "it = iter(loader)\n"
        "next(it)\n"  # left without close(), as a framework leaves its loader
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "SIGTERM ignored" not in out

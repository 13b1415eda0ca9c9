"""Tests for the shared-memory batch transport, with writers in real spawned processes."""

from __future__ import annotations

import collections
import gc
import multiprocessing as mp
import os
import pickle
import signal
import threading
import uuid
from typing import Any, NamedTuple

import numpy as np
import pytest

from globalloader.errors import ArgumentError, SharedMemoryError
from globalloader.transport.names import remove_leftovers
from globalloader.transport.segments import BatchReader, BatchWriter

SHM_DIR = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")


class Pair(NamedTuple):
    left: Any
    right: Any


def _serve(conn: Any) -> None:
    """Worker process: runs one BatchWriter per prefix on the parent's commands."""
    writers: dict[str, BatchWriter] = {}
    try:
        while True:
            command = conn.recv()
            try:
                if command[0] == "write":
                    _, prefix, batch, freed = command
                    if callable(batch):
                        batch = batch()  # built here: pickling can change arrays (byte order)
                    if prefix not in writers:
                        writers[prefix] = BatchWriter(prefix)
                    writers[prefix].free(freed)
                    conn.send((writers[prefix].write(batch), writers[prefix].segment_count))
                elif command[0] == "close":
                    writers.pop(command[1]).close()
                    conn.send(None)
                else:
                    return
            except Exception as exc:  # noqa: BLE001 - whatever the writer raised, the parent re-raises
                conn.send(exc)
    finally:
        for writer in writers.values():
            writer.close()


class _Worker:
    """A spawned process running `_serve`."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def send_write(self, prefix: str, batch: Any, freed: list[str] | tuple = ()) -> None:
        self.conn.send(("write", prefix, batch, list(freed)))

    def receive(self) -> Any:
        if not self.conn.poll(60):
            raise AssertionError("worker did not answer within 60 s")
        answer = self.conn.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def write(self, prefix: str, batch: Any, freed: list[str] | tuple = ()) -> tuple[Any, int]:
        """The message for `batch` and the writer's segment count after writing it."""
        self.send_write(prefix, batch, freed)
        return self.receive()

    def close_writer(self, prefix: str) -> None:
        self.conn.send(("close", prefix))
        self.receive()

    def stop(self) -> None:
        self.conn.send(("exit",))
        self.process.join(30)


@pytest.fixture(scope="module")
def worker() -> Any:
    process = _Worker()
    yield process
    process.stop()


@pytest.fixture
def prefix() -> Any:
    name = f"gl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    yield name
    remove_leftovers(name)


def _names(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def _assert_same(actual: Any, expected: Any) -> None:
    """Same structure, same container and leaf types, same array dtypes, shapes and values."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert np.array_equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual == expected


def _nested_batch() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    record = np.dtype([("x", "<i4"), ("y", "<f8", (2,))])
    return {
        "image": rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8),
        "strided": np.arange(60, dtype=np.float32).reshape(6, 10)[::2, 1::3],
        "fortran": np.asfortranarray(rng.normal(size=(5, 7))),
        "scalar0d": np.array(3, dtype=np.uint16),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "flags": np.array([True, False, True]),
        "half": np.linspace(0, 1, 9, dtype=np.float16),
        "complex": np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        "big_endian": np.arange(5, dtype=">i4"),
        "text": np.array(["ab", "c"]),
        "times": np.array(["2024-01-01", "2024-02-29"], dtype="datetime64[ns]"),
        "records": np.array([(1, (0.5, 1.5)), (2, (2.5, 3.5))], dtype=record),
        "objects": np.array(["a", None, 3], dtype=object),
        "numpy_scalar": np.float32(1.5),
        "key": ["sample-0", "sample-1"],
        "count": 7,
        "missing": None,
        "nested": {
            "pair": Pair(np.ones(3, dtype=np.int8), "right"),
            "tuple": (np.full((2, 2), 9.0), "text", 1),
            "list": [np.arange(4), [np.arange(2) * 5], "x"],
        },
    }


def test_nested_batch_round_trips_from_another_process(worker: _Worker, prefix: str) -> None:
    msg, _ = worker.write(prefix, _nested_batch)
    batch = _nested_batch()
    reader = BatchReader()
    out = reader.read(msg, lambda name: None)
    _assert_same(out, batch)
    assert out["strided"].flags.c_contiguous and out["fortran"].flags.c_contiguous
    assert isinstance(out["numpy_scalar"], np.float32)
    reader.close()


@pytest.mark.parametrize(
    "batch",
    [np.arange(12).reshape(3, 4), (np.ones(2), "label"), [np.zeros(3, dtype=np.uint8)], 42],
    ids=["bare-array", "tuple", "list", "int"],
)
def test_top_level_batch_of_any_shape(prefix: str, batch: Any) -> None:
    writer, reader = BatchWriter(prefix), BatchReader()
    try:
        _assert_same(reader.read(writer.write(batch), lambda name: None), batch)
    finally:
        writer.close()
        reader.close()


def test_arrays_are_writable_views_of_one_shared_segment(worker: _Worker, prefix: str) -> None:
    batch = {"a": np.arange(6), "b": [np.zeros((2, 3), dtype=np.float32)], "empty": np.zeros(0)}
    msg, _ = worker.write(prefix, batch)
    reader = BatchReader()
    first = reader.read(msg, lambda name: None)
    # Reading a message twice is not how it is used, but it shows the arrays are views of the
    # mapping, not copies: a write through one batch is seen through the other.
    second = reader.read(msg, lambda name: None)
    first["a"][0] = 100
    first["b"][0][1, 2] = 2.5
    assert second["a"][0] == 100 and second["b"][0][1, 2] == 2.5
    assert first["a"].flags.writeable
    assert first["a"].base is first["b"][0].base  # one base array per batch
    assert first["a"].base is not second["a"].base
    assert first["empty"].base is None  # empty arrays travel inline
    reader.close()


def test_message_is_small_whatever_the_batch_size(worker: _Worker, prefix: str) -> None:
    batch = {"image": np.zeros((64, 64, 64, 3), dtype=np.uint8), "label": np.arange(64)}
    msg, _ = worker.write(prefix, batch)
    assert len(pickle.dumps(msg)) < 400
    reader = BatchReader()
    _assert_same(reader.read(msg, lambda name: None), batch)
    reader.close()


def test_batch_without_arrays_needs_no_segment(worker: _Worker, prefix: str) -> None:
    batch = {"key": ["a", "b"], "label": (1, 2), "objects": np.array([None], dtype=object)}
    msg, count = worker.write(prefix, batch)
    released: list[str] = []
    reader = BatchReader()
    out = reader.read(msg, released.append)
    _assert_same(out, batch)
    del out
    gc.collect()
    assert count == 0 and released == [] and _names(prefix) == []


def test_release_waits_for_every_view_and_torch_tensor(worker: _Worker, prefix: str) -> None:
    torch = pytest.importorskip("torch")
    msg, _ = worker.write(prefix, {"a": np.arange(10), "b": np.ones((3, 3)), "key": "k"})
    released: list[str] = []
    reader = BatchReader()
    batch = reader.read(msg, released.append)
    part = batch["a"][2:5]
    tensor = torch.from_numpy(batch["b"][1:])
    del batch
    gc.collect()
    assert released == []
    del part
    gc.collect()
    assert released == []
    assert float(tensor.sum()) == 6.0  # still valid
    del tensor
    gc.collect()
    assert len(released) == 1 and released[0].startswith(prefix)
    reader.close()


def test_release_fires_in_the_thread_that_drops_the_batch(worker: _Worker, prefix: str) -> None:
    msg, _ = worker.write(prefix, {"a": np.arange(3)})
    threads: list[int] = []
    reader = BatchReader()
    holder = [reader.read(msg, lambda name: threads.append(threading.get_ident()))]
    dropper = threading.Thread(target=holder.clear)
    dropper.start()
    dropper.join()
    assert threads == [dropper.ident]
    reader.close()


def test_segments_are_reused_in_steady_state(worker: _Worker, prefix: str) -> None:
    reader = BatchReader()
    released: list[str] = []
    held: collections.deque[Any] = collections.deque(maxlen=2)  # the consumer keeps 2 batches
    counts, names = [], set()
    for i in range(30):
        freed, released[:] = released[:], []
        msg, count = worker.write(prefix, {"x": np.full(1000, i), "i": i}, freed)
        batch = reader.read(msg, released.append)
        assert batch["x"][0] == i and batch["i"] == i
        held.append(batch)
        counts.append(count)
        names.add(msg[0])
    assert max(counts) <= 3
    assert counts[5:] == [counts[5]] * 25  # no growth after the first batches
    assert len(names) == max(counts) and reader.mapped_count == len(names)
    reader.close()


def test_bigger_batch_retires_segments_too_small(worker: _Worker, prefix: str) -> None:
    reader = BatchReader()
    released: list[str] = []
    msg, _ = worker.write(prefix, {"x": np.zeros(1000)})
    del msg  # read nothing: keep the test about the writer
    msg, _ = worker.write(prefix, {"x": np.zeros(1000)})
    reader.read(msg, released.append)
    assert released  # dropped at once
    big = {"x": np.arange(3 << 20, dtype=np.uint8)}  # 3 MiB: more than a minimal segment
    msg, count = worker.write(prefix, big, released)
    # The released small segment was destroyed, the unread one is still in flight.
    assert count == 2
    out = reader.read(msg, lambda name: None)
    _assert_same(out, big)
    assert reader.mapped_count == 1  # the mapping of the retired segment was dropped
    reader.close()


def test_nothing_left_after_close(worker: _Worker, prefix: str) -> None:
    reader = BatchReader()
    read_msg, _ = worker.write(prefix, {"x": np.arange(10)})
    unread_msg, _ = worker.write(prefix, {"x": np.arange(10)})
    batch = reader.read(read_msg, lambda name: None)
    assert _names(prefix) == [unread_msg[0]]  # reading unlinked the read one
    worker.close_writer(prefix)
    assert _names(prefix) == []
    assert batch["x"].sum() == 45  # the consumer's views outlive the writer
    with pytest.raises(SharedMemoryError, match=unread_msg[0]):
        reader.read(unread_msg, lambda name: None)
    reader.close()
    assert batch["x"].sum() == 45  # and the reader's close
    assert _names(prefix) == []


def test_killed_writer_leaves_readable_batches_and_no_names(prefix: str) -> None:
    victim = _Worker()
    try:
        batches = [{"x": np.full(100, i), "i": i} for i in range(3)]
        msgs = [victim.write(prefix, b)[0] for b in batches]
        reader = BatchReader()
        released: list[str] = []
        first = reader.read(msgs[0], released.append)
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.join(30)
        assert victim.process.exitcode == -signal.SIGKILL
        _assert_same(first, batches[0])
        _assert_same(reader.read(msgs[1], released.append), batches[1])
        # msgs[2] was never read: only its name is left, for remove_leftovers.
        assert _names(prefix) == [msgs[2][0]]
        del first
        gc.collect()
        assert sorted(released) == sorted([msgs[0][0], msgs[1][0]])
        reader.close()
        assert remove_leftovers(prefix) == 1
        assert _names(prefix) == []
    finally:
        victim.conn.close()


def test_remove_leftovers_removes_only_its_prefix(prefix: str) -> None:
    other = prefix + "other-"  # shares the prefix: a separator-ended prefix avoids this
    mine, theirs = BatchWriter(prefix + "a-"), BatchWriter(other)
    try:
        mine.write({"x": np.ones(4)})
        mine.write({"x": np.ones(4)})
        theirs.write({"x": np.ones(4)})
        assert remove_leftovers(prefix + "a-") == 2
        assert len(_names(prefix + "a-")) == 0 and len(_names(other)) == 1
        assert remove_leftovers(prefix + "a-") == 0
    finally:
        mine.close()  # its names are gone already: no error
        theirs.close()
    assert _names(prefix) == []


def test_writer_skips_names_left_by_an_earlier_writer(prefix: str) -> None:
    crashed = BatchWriter(prefix)
    left = crashed.write({"x": np.ones(4)})  # never read, never closed
    restarted = BatchWriter(prefix)
    msg = restarted.write({"x": np.arange(4)})
    assert msg[0] != left[0]
    reader = BatchReader()
    _assert_same(reader.read(msg, lambda name: None), {"x": np.arange(4)})
    reader.close()
    restarted.close()
    crashed.close()
    assert _names(prefix) == []


def test_discard_returns_the_segment_to_free(prefix: str) -> None:
    writer, reader = BatchWriter(prefix), BatchReader()
    try:
        name = reader.discard(writer.write({"x": np.ones(4)}))
        writer.free([name])
        msg = writer.write({"x": np.arange(4)})
        assert msg[0] == name and writer.segment_count == 1
        _assert_same(reader.read(msg, lambda n: None), {"x": np.arange(4)})
    finally:
        writer.close()
        reader.close()


def test_torch_tensors_come_back_as_tensors(prefix: str) -> None:
    torch = pytest.importorskip("torch")
    writer, reader = BatchWriter(prefix), BatchReader()
    batch = {
        "image": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, 1:],
        "half": torch.ones(3, dtype=torch.bfloat16),  # no NumPy dtype: pickled inline
        "label": torch.tensor(5),
    }
    released: list[str] = []
    try:
        out = reader.read(writer.write(batch), released.append)
        assert all(isinstance(value, torch.Tensor) for value in out.values())
        for key in batch:
            assert out[key].dtype == batch[key].dtype and torch.equal(out[key], batch[key])
        image = out.pop("image")
        del out
        gc.collect()
        assert released == []  # the tensor keeps its segment
        del image
        gc.collect()
        assert len(released) == 1
    finally:
        writer.close()
        reader.close()


def test_errors_name_what_is_wrong(prefix: str) -> None:
    for bad in ["", "a/b"]:
        with pytest.raises(ArgumentError, match="prefix"):
            BatchWriter(bad)
    writer = BatchWriter(prefix)
    with pytest.raises(ArgumentError, match="gl-nope-1"):
        writer.free(["gl-nope-1"])
    writer.close()
    with pytest.raises(ArgumentError, match="closed"):
        writer.write({"x": np.ones(2)})


def test_full_shared_memory_raises_instead_of_crashing(prefix: str) -> None:
    stats = os.statvfs(SHM_DIR)
    if stats.f_blocks * stats.f_frsize >= 1 << 40:
        pytest.skip("shared-memory folder larger than the batch used to overflow it")
    writer = BatchWriter(prefix)
    huge = np.broadcast_to(np.uint8(0), (1 << 40,))  # 1 TiB that takes no memory here
    with pytest.raises(SharedMemoryError, match="cannot allocate"):
        writer.write({"x": huge})
    assert _names(prefix) == [] and writer.segment_count == 0
    msg = writer.write({"x": np.ones(3)})  # the writer still works
    assert msg[0] is not None
    writer.close()

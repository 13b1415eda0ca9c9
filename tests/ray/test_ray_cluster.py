"""The global shuffle on multi-node Ray clusters started on this machine, with faults.

Each node is its own raylet with its own object store and a custom resource naming it, so each
trainer actor is pinned to a node. One cluster per test class; the clusters are always shut down.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.cloudpickle
from ray.cluster_utils import Cluster
from ray.experimental import get_object_locations

import globalloader as gl
from globalloader.errors import ArgumentTypeError, GlobalLoaderError
from globalloader.ray import ShufflingDataset
from globalloader.ray.dataset import NAMESPACE
from helpers import stop_ray

pytestmark = pytest.mark.integration

FILE_ROWS = [301, 250, 0, 417, 123, 509, 388, 275]  # uneven, and one empty file
TOTAL = sum(FILE_ROWS)
BATCH = 32
PAYLOAD = 4096  # bytes per row: map and reducer outputs exceed 100 KiB, so they live in the object
# stores of the nodes that made them (smaller objects travel inline with their owner, never lost)
STORE = 80 * 2**20  # a small object store per node
ARGS = {"num_epochs": 2, "num_trainers": 3, "batch_size": BATCH, "num_reducers": 6, "seed": 5, "timeout": 120.0}
FAST_FAILURE_DETECTION = {  # a dead node is noticed in about 3 s instead of about 30 s
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}

Keys = list[list[np.ndarray]]  # [epoch][batch] -> keys


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """Parquet files whose row with key k has PAYLOAD bytes k % 251."""
    folder = tmp_path_factory.mktemp("cluster")
    paths, start = [], 0
    for i, rows in enumerate(FILE_ROWS):
        key = np.arange(start, start + rows, dtype=np.int64)
        payload = np.repeat((key % 251)[:, None], PAYLOAD, axis=1).astype(np.uint8)
        binary = pa.FixedSizeBinaryArray.from_buffers(pa.binary(PAYLOAD), rows, [None, pa.py_buffer(payload.tobytes())])
        pq.write_table(pa.table({"key": key, "payload": binary}), folder / f"part-{i}.parquet")
        paths.append(str(folder / f"part-{i}.parquet"))
        start += rows
    return paths


def check_rows(batch: dict[str, np.ndarray]) -> None:
    """Columns were permuted together: every row still matches its key."""
    assert (batch["payload"] == (batch["key"] % 251)[:, None]).all()


def read_in_process(files: Any, args: dict[str, Any]) -> list[Keys]:
    """Every rank in this one process, rank after rank and epoch after epoch: [rank][epoch][batch]."""
    name = uuid.uuid4().hex
    ranks = [ShufflingDataset(files, rank=r, name=name, **args) for r in range(args["num_trainers"])]
    out: list[Keys] = [[] for _ in ranks]
    try:
        for epoch in range(args["num_epochs"]):
            for ds, keys in zip(ranks, out, strict=True):
                ds.set_epoch(epoch)
                keys.append([np.array(batch["key"]) for batch in ds])
    finally:
        for ds in ranks[::-1]:
            ds.close()
    return out


@pytest.fixture(scope="module")
def one_node(files, tmp_path_factory) -> list[Keys]:
    """The shuffle of ARGS on a one-node Ray, before any cluster starts: the reference order."""
    cache = tmp_path_factory.mktemp("ray-cache")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=STORE,
        log_to_driver=False,
        runtime_env={"env_vars": {"GLOBALLOADER_CACHE_DIR": str(cache)}},
    )
    try:
        return read_in_process(files, ARGS)
    finally:
        stop_ray()


def start_cluster(nodes: dict[str, int], cache: Any) -> tuple[Cluster, dict[str, Any]]:
    """A cluster of one raylet per entry {resource name: CPUs}, the first the head, ray.init'ed
    from this process; also returns the worker nodes by name (to remove one)."""
    (head, head_cpus), *others = nodes.items()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "resources": {head: 1},
            "object_store_memory": STORE,
            "_system_config": FAST_FAILURE_DETECTION,
        },
    )
    workers = {}
    try:
        for name, cpus in others:
            workers[name] = cluster.add_node(num_cpus=cpus, resources={name: 1}, object_store_memory=STORE)
        cluster.wait_for_nodes()
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors are defined here
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"GLOBALLOADER_CACHE_DIR": str(cache)}},
        )
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, workers


def stop_cluster(cluster: Cluster) -> None:
    stop_ray(cluster.shutdown)


class Trainer:
    """One rank in its own process. `read` runs in one thread; `progress`, `partial` and
    `state_dict` answer from another while it runs (the actor has two threads)."""

    def __init__(self) -> None:
        self.ds: ShufflingDataset | None = None
        self.keys: Keys = []
        self.batches = 0
        self.unfinished: tuple[int, Iterator[dict[str, np.ndarray]]] | None = None  # (epoch, its iterator)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def open(self, files: Any, rank: int, args: dict[str, Any], state: dict[str, Any] | None = None) -> int | None:
        self.ds = ShufflingDataset(files, rank=rank, **args)
        if state is not None:
            self.ds.load_state_dict(state)
        try:
            return len(self.ds)
        except ArgumentTypeError:  # a chain with a filter: batches are known per epoch only
            return None

    def read(self, epochs: list[int], stop_after: int | None = None, delay: float = 0.0) -> Any:
        """Keys of every batch read, per epoch; (error class, message) if reading failed. An
        epoch left after `stop_after` of its batches goes on where it stopped when read again."""
        try:
            for epoch in epochs:
                if self.unfinished is not None and self.unfinished[0] == epoch:
                    batches = self.unfinished[1]
                else:
                    self.ds.set_epoch(epoch)
                    self.keys.append([])
                    batches = iter(self.ds)
                self.unfinished = None
                for batch in batches:
                    check_rows(batch)
                    self.keys[-1].append(np.array(batch["key"]))
                    self.batches += 1
                    time.sleep(delay)
                    if len(self.keys[-1]) == stop_after:
                        self.unfinished = (epoch, batches)
                        break
        except GlobalLoaderError as exc:
            return type(exc).__name__, str(exc)
        return self.keys

    def progress(self) -> int:
        return self.batches

    def partial(self) -> Keys:
        return self.keys

    def state_dict(self) -> dict[str, Any]:
        return self.ds.state_dict()

    def stats(self) -> dict[int, dict[str, float]]:
        return self.ds.epoch_stats

    def close(self) -> None:
        if self.ds is not None:
            self.ds.close()
            self.ds = None


def start_trainer(node: str) -> Any:
    """A trainer actor pinned to the node that holds resource `node`."""
    return ray.remote(Trainer).options(num_cpus=0, resources={node: 0.01}, max_concurrency=2).remote()


def open_all(trainers: list[Any], files: Any, args: dict[str, Any], states: list[Any] | None = None) -> None:
    states = states or [None] * len(trainers)
    lengths = ray.get([t.open.remote(files, r, args, s) for r, (t, s) in enumerate(zip(trainers, states, strict=True))])
    assert len(set(lengths)) == 1, lengths


def close_all(trainers: list[Any]) -> None:
    ray.get([t.close.remote() for t in trainers[::-1]], timeout=60)  # rank 0 last: it ends the queue


def wait_for_progress(trainers: list[Any], batches: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while min(ray.get([t.progress.remote() for t in trainers])) < batches:
        assert time.monotonic() < deadline, "the trainers made no progress"
        time.sleep(0.05)


def made_outputs(name: str, epoch: int, timeout: float = 60.0) -> list[Any]:
    """The refs of every rank's reducer outputs of `epoch`, asked of the batch queue, once made."""
    queue = ray.get_actor(name, namespace=NAMESPACE)
    per_rank = LOSS_ARGS["num_reducers"] // LOSS_ARGS["num_trainers"]
    refs, deadline = [], time.monotonic() + timeout
    for rank in range(LOSS_ARGS["num_trainers"]):
        for index in range(per_rank):
            while (answer := ray.get(queue.output.remote(rank, epoch, index, 1.0)))[0] != "ok":
                assert time.monotonic() < deadline, answer
            refs.append(answer[1])
    assert len(ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)[0]) == len(refs)
    return refs


def assert_every_row_once(out: list[Keys], epochs: int) -> None:
    """Every epoch: each row exactly once across the ranks, and equal batch counts per rank."""
    for e in range(epochs):
        assert len({len(rank[e]) for rank in out}) == 1, [len(rank[e]) for rank in out]
        keys = np.concatenate([k for rank in out for k in rank[e]])
        assert len(keys) == TOTAL and (np.sort(keys) == np.arange(TOTAL)).all()


def assert_same(out: list[Keys], reference: list[Keys]) -> None:
    for rank, (got, want) in enumerate(zip(out, reference, strict=True)):
        for e, (a, b) in enumerate(zip(got, want, strict=True)):
            assert len(a) == len(b), (rank, e)
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {rank} epoch {e} differs"


THREE_NODES = {"node-a": 1, "node-b": 1, "node-c": 1}  # resource name -> CPUs; the first is the head


@pytest.fixture(scope="class")
def cluster(one_node, tmp_path_factory) -> Iterator[Cluster]:
    cluster, _ = start_cluster(THREE_NODES, tmp_path_factory.mktemp("ray-cache"))
    yield cluster
    stop_cluster(cluster)


@pytest.fixture(scope="class")
def run(cluster, files) -> dict[str, Any]:
    """ARGS read by three trainers on three nodes: keys, node ids and epoch stats per rank."""
    trainers = [start_trainer(node) for node in THREE_NODES]
    args = {**ARGS, "name": uuid.uuid4().hex}
    try:
        open_all(trainers, files, args)
        out = ray.get([t.read.remote(list(range(ARGS["num_epochs"]))) for t in trainers], timeout=120)
        stats = ray.get([t.stats.remote() for t in trainers])
        nodes = ray.get([t.node.remote() for t in trainers])
        close_all(trainers)
    finally:
        for t in trainers:
            ray.kill(t)
    return {"keys": out, "stats": stats, "nodes": nodes}


class TestThreeNodes:
    """Head node-a, node-b and node-c, one CPU each; rank r's trainer on the r-th node."""

    def test_trainers_run_on_three_nodes(self, run):
        assert len(set(run["nodes"])) == 3
        assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 3

    def test_every_row_once_per_epoch_in_equal_batch_counts(self, run):
        assert all(isinstance(rank, list) for rank in run["keys"]), run["keys"]
        assert_every_row_once(run["keys"], ARGS["num_epochs"])

    def test_same_batches_as_on_one_node(self, run, one_node):
        assert_same(run["keys"], one_node)

    def test_reducers_run_on_their_trainers_node(self, run):
        """No reducer output had to cross nodes: each was made where its trainer is."""
        for rank, stats in enumerate(run["stats"]):
            assert sorted(stats) == list(range(ARGS["num_epochs"]))
            for epoch, s in stats.items():
                assert (s["pulled_outputs"], s["pulled_bytes"]) == (0, 0), (rank, epoch, s)

    def test_a_killed_trainer_restarted_from_its_state_resumes_exactly(self, cluster, files, one_node):
        trainers = [start_trainer(node) for node in THREE_NODES]
        args = {**ARGS, "name": uuid.uuid4().hex}
        try:
            open_all(trainers, files, args)
            first_life = ray.get(trainers[1].read.remote([0], stop_after=5), timeout=60)
            state = ray.get(trainers[1].state_dict.remote())
            assert state["epoch"] == 0 and state["task"] == 5
            ray.kill(trainers[1], no_restart=True)  # dies mid-epoch, holding epoch 0 of rank 1
            others = [t.read.remote([0, 1]) for t in (trainers[0], trainers[2])]
            trainers[1] = start_trainer("node-b")
            assert ray.get(trainers[1].open.remote(files, 1, args, state), timeout=60) == len(one_node[1][0])
            second_life = ray.get(trainers[1].read.remote([0, 1]), timeout=120)
            out = [ray.get(others[0], timeout=120), first_life, ray.get(others[1], timeout=120)]
            assert all(isinstance(rank, list) for rank in [*out, second_life]), [*out, second_life]
            out[1] = [first_life[0] + second_life[0], second_life[1]]
            assert_same(out, one_node)
            close_all(trainers)
        finally:
            for t in trainers:
                ray.kill(t)

    def test_a_trainer_restarted_behind_a_freed_epoch_is_told_to_restart_every_rank(self, cluster, files):
        trainers = [start_trainer(node) for node in THREE_NODES]
        args = {**ARGS, "name": uuid.uuid4().hex}
        try:
            open_all(trainers, files, args)
            ray.get(trainers[2].read.remote([0], stop_after=3), timeout=60)
            old_state = ray.get(trainers[2].state_dict.remote())
            assert isinstance(ray.get(trainers[2].read.remote([0, 1], stop_after=2), timeout=60), list)
            assert all(isinstance(r, list) for r in ray.get([t.read.remote([0]) for t in trainers[:2]], timeout=60))
            ray.kill(trainers[2], no_restart=True)  # every rank has left epoch 0: it is freed
            trainers[2] = start_trainer("node-c")
            ray.get(trainers[2].open.remote(files, 2, args, old_state), timeout=60)
            error = ray.get(trainers[2].read.remote([0, 1]), timeout=60)
            assert error[0] == "StateError" and "epoch 0 was freed" in error[1], error
            assert "restart every rank" in error[1]
            close_all(trainers)
        finally:
            for t in trainers:
                ray.kill(t)

    def test_a_dead_batch_queue_fails_every_rank_soon_and_states_resume(self, cluster, files, one_node):
        """The queue is killed mid-epoch: each rank raises WorkerError within seconds, although its
        timeout is ten minutes; restarted from their states the ranks read exactly the rest."""
        trainers = [start_trainer(node) for node in THREE_NODES]
        args = {**ARGS, "name": uuid.uuid4().hex, "timeout": 600.0}
        try:
            open_all(trainers, files, args)
            reads = [t.read.remote([0, 1], delay=0.02) for t in trainers]
            wait_for_progress(trainers, 4)
            ray.kill(ray.get_actor(args["name"], namespace=NAMESPACE))
            killed = time.monotonic()
            errors = ray.get(reads, timeout=60)
            assert time.monotonic() - killed < 30
            for error in errors:
                assert error[0] == "WorkerError" and "state_dict()" in error[1], error
            states = ray.get([t.state_dict.remote() for t in trainers])
            before = ray.get([t.partial.remote() for t in trainers])
            close_all(trainers)
            for t in trainers:
                ray.kill(t)
            trainers = [start_trainer(node) for node in THREE_NODES]
            open_all(trainers, files, args, states)
            epochs = [list(range(s["epoch"], ARGS["num_epochs"])) for s in states]
            after = ray.get([t.read.remote(e) for t, e in zip(trainers, epochs, strict=True)], timeout=120)
            assert all(isinstance(rank, list) for rank in after), after
            out = []
            for b, a, s in zip(before, after, states, strict=True):
                partial = b[s["epoch"]] if len(b) > s["epoch"] else []  # the epoch the kill cut short
                assert len(partial) == s["task"]  # the state counts exactly the batches delivered
                out.append([*b[: s["epoch"]], partial + a[0], *a[1:]])
            assert_same(out, one_node)
            close_all(trainers)
        finally:
            for t in trainers:
                ray.kill(t)


LOSS_NODES = {"node-a": 0, "node-b": 0, "worker-1": 1, "worker-2": 1}
LOSS_ARGS = {**ARGS, "num_trainers": 2, "num_reducers": 4}


@pytest.fixture(scope="class")
def loss_cluster(tmp_path_factory) -> Iterator[tuple[Cluster, dict[str, Any]]]:
    cluster, workers = start_cluster(LOSS_NODES, tmp_path_factory.mktemp("ray-cache"))
    yield cluster, workers
    stop_cluster(cluster)


def lose_a_worker_mid_epoch(loss_cluster: tuple[Cluster, dict[str, Any]], data: Any, reference: list[Keys]) -> Any:
    """Two trainers read LOSS_ARGS from `data` while the worker node holding epoch-1 outputs that
    only it has is removed (and a fresh worker-3 added); what each rank read."""
    cluster, workers = loss_cluster
    trainers = [start_trainer(node) for node in ("node-a", "node-b")]
    args = {**LOSS_ARGS, "name": uuid.uuid4().hex}
    try:
        open_all(trainers, data, args)
        reads = [t.read.remote([0, 1], delay=0.15) for t in trainers]
        wait_for_progress(trainers, 3)
        deadline = time.monotonic() + 10  # the worker node holding outputs of epoch 1 only it has
        while True:
            ahead = made_outputs(args["name"], epoch=1)  # shuffled while the trainers read epoch 0
            places = get_object_locations(ahead)
            only = {
                name: [ref for ref, where in places.items() if where["node_ids"] == [workers[name].node_id]]
                for name in ("worker-1", "worker-2")
            }
            doomed = max(only, key=lambda name: len(only[name]))
            if only[doomed] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        only_there = only[doomed]
        assert max(ray.get([t.progress.remote() for t in trainers])) < len(reference[0][0])  # still epoch 0
        cluster.remove_node(workers[doomed], allow_graceful=False)
        cluster.add_node(num_cpus=1, resources={"worker-3": 1}, object_store_memory=STORE)
        del ahead
        assert only_there, "no output lived only on the removed node: nothing was lost"
        out = ray.get(reads, timeout=120)
        assert all(isinstance(rank, list) for rank in out), out
        assert_same(out, reference)  # Ray made the lost outputs again, from the same seeds
        # Trainers' nodes have no CPU: every output is pulled from another node. An output lost with
        # its node (one of epoch 1, made ahead, or one of epoch 0 the trainer had not reached) lives
        # nowhere while Ray makes it again, so the count may miss it (as `OutputPrefetcher` says).
        for stats in ray.get([t.stats.remote() for t in trainers]):
            for epoch in (0, 1):
                assert 1 <= stats[epoch]["pulled_outputs"] <= 2 and stats[epoch]["pulled_bytes"] > 0, stats
        close_all(trainers)
        return out
    finally:
        for t in trainers:
            ray.kill(t)


class TestNodeLoss:
    """Trainers on node-a (head) and node-b, which have no CPUs; every map and reduce task runs on
    worker-1 or worker-2. The one holding outputs only it has is removed mid-epoch (and a fresh
    worker-3 added)."""

    def test_a_worker_node_lost_mid_epoch_loses_and_repeats_no_row(self, loss_cluster, files):
        reference = read_in_process(files, LOSS_ARGS)  # the driver runs on the head: no worker lost
        out = lose_a_worker_mid_epoch(loss_cluster, files, reference)
        assert_every_row_once(out, LOSS_ARGS["num_epochs"])


def unpack(r: dict[str, Any]) -> dict[str, Any]:
    return {"key": r["key"], "payload": np.frombuffer(r["payload"], np.uint8)}


def jitter(r: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {**r, "noise": rng.random()}


def keep(r: dict[str, Any]) -> bool:
    return r["noise"] < 0.6  # a random set of rows, another each epoch


def split(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Every third row twice, the copy under a key of its own with the same payload (key % 251)."""
    return [r, {**r, "key": r["key"] + 251 * 4000}] if r["key"] % 3 == 0 else [r]


@pytest.mark.slow
class TestNodeLossWithAChain:
    """As TestNodeLoss, with a chain whose maps, random map, filter and flat_map run in the map
    tasks (two stages: the rows of an epoch are known only once the chain ran on every part)."""

    def test_a_worker_node_lost_mid_epoch_gives_the_chains_rows_exactly(self, loss_cluster, files):
        chain = gl.Dataset(gl.Parquet(files)).map(unpack).map(jitter).filter(keep).flat_map(split)
        reference = read_in_process(chain, LOSS_ARGS)
        out = lose_a_worker_mid_epoch(loss_cluster, chain, reference)
        for e in range(LOSS_ARGS["num_epochs"]):
            keys = np.sort(np.concatenate([k for rank in out for k in rank[e]]))
            assert keys.tolist() == sorted(r["key"] for r in chain.iterator(e))  # every surviving row once

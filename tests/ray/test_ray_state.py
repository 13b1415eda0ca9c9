"""A trainer's state in the Loader's form: checked by the Loader's code, elastic between epochs,
and the Loader's timeout error when a wait runs out. Trainers are Ray actor processes."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.cloudpickle

import globalloader as gl
from globalloader.dataset.saved_state import SavedState
from globalloader.errors import GlobalLoaderError, LoaderTimeoutError, StateError
from globalloader.ray import ShufflingDataset

FILE_ROWS = [200, 151, 173]
TOTAL = sum(FILE_ROWS)
BATCH = 16

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    folder, start, paths = tmp_path_factory.mktemp("state"), 0, []
    for i, rows in enumerate(FILE_ROWS):
        pq.write_table(pa.table({"key": np.arange(start, start + rows, dtype=np.int64)}), folder / f"{i}.parquet")
        paths.append(str(folder / f"{i}.parquet"))
        start += rows
    return paths


class Rank:
    """One trainer in its own process: reads an epoch and keeps its state after every batch."""

    def open(self, files: list[str], rank: int, args: dict[str, Any], state: Any = None) -> Any:
        try:
            self.ds = ShufflingDataset(files, rank=rank, **args)
            if state is not None:
                self.ds.load_state_dict(state)
        except GlobalLoaderError as exc:
            return type(exc).__name__, str(exc)
        return len(self.ds)

    def read(self, epoch: int) -> tuple[list[list[int]], dict[str, Any]]:
        """The keys of each batch of `epoch`, and the state taken right after its last batch."""
        self.ds.set_epoch(epoch)
        keys, state = [], self.ds.state_dict()
        for batch in self.ds:
            keys.append(batch["key"].tolist())
            state = self.ds.state_dict()
        return keys, state

    def close(self) -> None:
        self.ds.close()
        del self.ds


@pytest.fixture(scope="module")
def ranks(cluster) -> Any:
    """Three trainer processes, opened anew by each run (starting a process is most of a run's time)."""
    actors = [ray.remote(num_cpus=0)(Rank).remote() for _ in range(3)]
    yield actors
    for actor in actors:
        ray.kill(actor)


def run(ranks: list[Any], files: list[str], args: dict[str, Any], epochs: list[int], states: Any = None) -> list[Any]:
    """`args["num_trainers"]` ranks open (loading `states`) and read `epochs`; [epoch][rank] -> (keys, state)."""
    ranks = ranks[: args["num_trainers"]]
    args = {**args, "name": uuid.uuid4().hex}
    states = states or [None] * len(ranks)
    opened = ray.get([r.open.remote(files, i, args, s) for i, (r, s) in enumerate(zip(ranks, states, strict=True))])
    assert all(isinstance(n, int) for n in opened), opened
    try:
        return [ray.get([r.read.remote(epoch) for r in ranks], timeout=120) for epoch in epochs]
    finally:
        ray.get([r.close.remote() for r in ranks[::-1]])  # rank 0 last: it ends the batch queue


def assert_every_row_once(epoch: list[Any]) -> None:
    keys = sorted(k for keys, _ in epoch for batch in keys for k in batch)
    assert keys == list(range(TOTAL))
    assert len({len(keys) for keys, _ in epoch}) == 1  # equal batch counts


@pytest.mark.slow
def test_trainers_two_then_three_continue_at_the_next_epoch_as_a_fresh_three_trainer_run(ranks, files):
    args = {"num_epochs": 2, "batch_size": BATCH, "seed": 7}
    (old,) = run(ranks, files, {**args, "num_trainers": 2}, [0])
    assert_every_row_once(old)
    states = [state for _, state in old]
    for rank, state in enumerate(states):  # the Loader's form, at the start of epoch 1
        saved = SavedState.from_json(state, None)
        assert (saved.epoch, saved.task, saved.offset, saved.samples) == (1, 0, 0, 0)
        assert (saved.rank, saved.world, saved.batch_size) == (rank, 2, BATCH)
    assert states[0]["fingerprint"] == states[1]["fingerprint"]
    # new ranks 0 and 1 load one old rank's state each (any rank's will do); rank 2 the list of all
    (resumed,) = run(ranks, files, {**args, "num_trainers": 3}, [1], [states[1], states[0], states])
    (fresh,) = run(ranks, files, {**args, "num_trainers": 3}, [1])
    assert_every_row_once(resumed)
    assert [keys for keys, _ in resumed] == [keys for keys, _ in fresh]
    assert [s["fingerprint"] for _, s in resumed] == [states[0]["fingerprint"]] * 3  # the trainer count is not in it


def test_a_mid_epoch_state_of_another_number_of_trainers_says_to_save_at_an_epoch_boundary(cluster, files):
    with ShufflingDataset(files, 2, 1, BATCH, 0, seed=7, name=uuid.uuid4().hex) as one:
        batches = iter(one)
        next(batches)
        mid = one.state_dict()
        assert (mid["epoch"], mid["task"], mid["samples"], mid["shard"]) == (0, 1, BATCH, [0, 1, "none"])
    with ShufflingDataset(files, 2, 2, BATCH, 0, seed=7, name=uuid.uuid4().hex) as two:
        with pytest.raises(StateError, match=r"mid-epoch .* by 1 trainers.* epoch boundary"):
            two.load_state_dict(mid)
        two.load_state_dict({**mid, "epoch": 1, "task": 0, "samples": 0})  # at a boundary: any trainer count
        assert (two.state_dict()["epoch"], two.state_dict()["shard"]) == (1, [0, 2, "none"])


def test_states_are_checked_by_the_loaders_code_with_its_wording(cluster, files):
    loader = gl.Loader(gl.Dataset(gl.Parquet(files)).shuffle(seed=7).batch(BATCH))
    with ShufflingDataset(files, 1, 1, BATCH, 0, seed=7, name=uuid.uuid4().hex) as ds:
        state = ds.state_dict()
        for bad in ({"shuffle": "x", "epoch": 0, "batches": 0}, {**state, "shard": [3, 2, "none"]}, [], 7):
            with pytest.raises(StateError) as by_loader:
                loader.load_state_dict(bad)
            with pytest.raises(StateError) as by_ray:
                ds.load_state_dict(bad)
            assert str(by_ray.value) == str(by_loader.value)
        # each refuses the other's chain, naming the parts that differ
        with pytest.raises(StateError, match=r"different chain: .*index operators"):
            ds.load_state_dict(loader.state_dict())
        with pytest.raises(StateError, match=r"different chain: .*index operators"):
            loader.load_state_dict(state)
        with pytest.raises(StateError, match=r"different chain: the root seed"):
            ds.load_state_dict(ShufflingDataset(files, 1, 1, BATCH, 0, seed=8, name=uuid.uuid4().hex).state_dict())
        with pytest.raises(StateError, match="'samples' = 3 does not match its position"):
            ds.load_state_dict({**state, "task": 1, "samples": 3})


def test_a_rank_that_cannot_join_in_time_raises_the_loaders_timeout_error(cluster, files):
    with pytest.raises(LoaderTimeoutError, match=r"rank 1 could not join .* within 1 s \(timeout=\)"):
        ShufflingDataset(files, 1, 2, BATCH, 1, timeout=1.0, name=uuid.uuid4().hex)

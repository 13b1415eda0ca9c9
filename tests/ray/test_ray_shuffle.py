"""The global shuffle on a local Ray cluster, with trainer ranks as separate actor processes."""

from __future__ import annotations

import gzip
import itertools
import pathlib
import subprocess
import sys
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.cloudpickle

from globalloader.errors import (
    ArgumentError,
    GlobalLoaderError,
    SourceError,
    StateError,
)
from globalloader.ray import ShufflingDataset
from globalloader.ray.dataset import NAMESPACE
from globalloader.sources import TarWriter
from helpers import check_resume

FILE_ROWS = [301, 250, 0, 417, 123, 509]  # uneven, and one empty file
TOTAL = sum(FILE_ROWS)
BATCH = 32

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """Parquet files whose row with key k has payload bytes k % 251 and score k / 2."""
    folder = tmp_path_factory.mktemp("shuffle")
    paths, start = [], 0
    for i, rows in enumerate(FILE_ROWS):
        key = np.arange(start, start + rows, dtype=np.int64)
        payload = np.repeat((key % 251)[:, None], 8, axis=1).astype(np.uint8)
        pq.write_table(
            pa.table(
                {
                    "key": key,
                    "payload": pa.FixedSizeBinaryArray.from_buffers(
                        pa.binary(8), rows, [None, pa.py_buffer(payload.tobytes())]
                    ),
                    "score": key.astype(np.float32) / 2,
                }
            ),
            folder / f"part-{i}.parquet",
        )
        paths.append(str(folder / f"part-{i}.parquet"))
        start += rows
    return paths


def check_rows(batch: dict[str, np.ndarray]) -> None:
    """Columns were permuted together: every row still matches its key."""
    key = batch["key"]
    assert (batch["payload"] == (key % 251)[:, None]).all()
    assert (batch["score"] == key.astype(np.float32) / 2).all()


class Trainer:
    """One rank in its own process: opens the dataset, reads epochs, reports keys per batch."""

    def __init__(self) -> None:
        self.ds: ShufflingDataset | None = None

    def open(self, files: Any, rank: int, kwargs: dict[str, Any]) -> Any:
        try:
            self.ds = ShufflingDataset(files, rank=rank, **kwargs)
        except GlobalLoaderError as exc:
            return type(exc).__name__, str(exc)
        return len(self.ds)

    def read(self, epochs: list[int], stop_after: int | None = None) -> Any:
        out = []
        try:
            for epoch in epochs:
                self.ds.set_epoch(epoch)
                keys = []
                for batch in self.ds:
                    if "payload" in batch:
                        check_rows(batch)
                    keys.append(np.array(batch["key" if "key" in batch else "__key__"]))
                    if len(keys) == stop_after:
                        break
                out.append(keys)
        except GlobalLoaderError as exc:
            return type(exc).__name__, str(exc)
        return out

    def close(self) -> None:
        if self.ds is not None:
            self.ds.close()
            self.ds = None


@pytest.fixture(scope="module")
def trainers(cluster):
    actors = [ray.remote(num_cpus=0)(Trainer).remote() for _ in range(2)]
    yield actors
    for actor in actors:
        ray.kill(actor)


def run(trainers, files, epochs: int, **kwargs) -> list[list[list[np.ndarray]]]:
    """Both ranks read `epochs` epochs concurrently; [rank][epoch][batch] -> keys."""
    args = {"num_epochs": epochs, "num_trainers": len(trainers), "batch_size": BATCH, **kwargs}
    lengths = ray.get([t.open.remote(files, r, args) for r, t in enumerate(trainers)])
    assert all(isinstance(n, int) for n in lengths), lengths
    try:
        out = ray.get([t.read.remote(list(range(epochs))) for t in trainers])
    finally:  # rank 0 last: closing it stops the batch queue
        ray.get([t.close.remote() for t in trainers[::-1]])
    for rank_out, n in zip(out, lengths, strict=True):
        assert isinstance(rank_out, list), rank_out
        assert all(len(batches) == n for batches in rank_out)
    return out


@pytest.fixture(scope="module")
def three_epochs(trainers, files):
    return run(trainers, files, 3, num_reducers=4, seed=11)


def test_every_row_once_per_epoch_in_equal_batch_counts(three_epochs):
    counts = {len(epoch) for rank in three_epochs for epoch in rank}
    assert counts == {-(-TOTAL // (2 * BATCH))}  # the same count for both ranks, every epoch
    for e in range(3):
        keys = np.concatenate([k for rank in three_epochs for k in rank[e]])
        assert len(keys) == TOTAL and (np.sort(keys) == np.arange(TOTAL)).all()
        sizes = [[len(k) for k in rank[e]] for rank in three_epochs]
        assert all(s[:-1] == [BATCH] * (len(s) - 1) for s in sizes)  # only last batches short
        assert abs(sizes[0][-1] - sizes[1][-1]) <= 1  # the leftover split evenly


def test_each_epoch_is_a_new_well_mixed_order(three_epochs):
    orders = [np.concatenate(three_epochs[0][e] + three_epochs[1][e]) for e in range(3)]
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    position = np.arange(TOTAL)
    for order in orders:  # keys follow file order: no trace of it may survive the shuffle
        assert abs(np.corrcoef(order, position)[0, 1]) < 0.1  # |rho| ~ 0.02 if random
    rank_of = np.empty(TOTAL, int)  # rows change trainers between epochs too
    for e in range(2):
        for r in range(2):
            for k in three_epochs[r][e]:
                rank_of[k] = r if e == 0 else rank_of[k] * 2 + r
    assert np.bincount(rank_of, minlength=4).min() > TOTAL / 4 * 0.8
    starts = np.cumsum([0, *FILE_ROWS])
    files_per_batch = [len(np.unique(np.searchsorted(starts, k, side="right"))) for k in three_epochs[0][0]]
    assert np.mean(files_per_batch) > 4.5  # of the 5 non-empty files


def test_same_seed_same_batches_other_seed_other_batches(trainers, files, three_epochs):
    again = run(trainers, files, 3, num_reducers=4, seed=11)
    for rank in range(2):
        for e in range(3):
            assert all(np.array_equal(a, b) for a, b in zip(three_epochs[rank][e], again[rank][e], strict=True))
    other = run(trainers, files, 1, num_reducers=4, seed=12)
    assert not np.array_equal(np.concatenate(other[0][0]), np.concatenate(three_epochs[0][0]))


def test_drop_last_gives_only_full_batches_of_distinct_rows(trainers, files):
    out = run(trainers, files, 2, drop_last=True, max_concurrent_epochs=1)
    per_round = 2 * BATCH
    for e in range(2):
        batches = [k for rank in out for k in rank[e]]
        assert {len(k) for k in batches} == {BATCH}
        keys = np.concatenate(batches)
        assert len(keys) == TOTAL // per_round * per_round == len(np.unique(keys))


def test_tar_shards_are_shuffled_like_parquet(trainers, tmp_path):
    with TarWriter(str(tmp_path / "shard-%06d.tar"), maxcount=40) as writer:
        for i in range(150):
            writer.write({"__key__": f"k{i:04d}", "cls": i, "bin": i.to_bytes(2, "little")})
    out = run(trainers, writer.paths, 1, batch_size=16, columns=["__key__", "cls", "bin"])
    rows = [k for rank in out for k in rank[0]]
    keys = np.concatenate(rows)
    assert sorted(keys.tolist()) == [f"k{i:04d}" for i in range(150)]


def test_gzip_shards_give_the_same_batches_as_the_same_tar_shards(trainers, tmp_path):
    with TarWriter(str(tmp_path / "shard-%06d.tar"), maxcount=40) as writer:
        for i in range(150):
            writer.write({"__key__": f"k{i:04d}", "cls": i})
    packed = [path + ".gz" for path in writer.paths[:2]] + [path[: -len(".tar")] + ".tgz" for path in writer.paths[2:]]
    for path, gz in zip(writer.paths, packed, strict=True):
        pathlib.Path(gz).write_bytes(gzip.compress(pathlib.Path(path).read_bytes()))
    args = {"batch_size": 16, "columns": ["__key__", "cls"], "seed": 5}
    plain = run(trainers, writer.paths, 2, **args)
    streamed = run(trainers, packed, 2, **args)
    as_lists = [[[b.tolist() for b in epoch] for epoch in rank] for rank in streamed]
    assert as_lists == [[[b.tolist() for b in epoch] for epoch in rank] for rank in plain]  # same seed, same order
    keys = sorted(k for rank in as_lists for k in itertools.chain.from_iterable(rank[1]))
    assert keys == [f"k{i:04d}" for i in range(150)]


class TestFailures:
    def test_unreadable_file_at_construction_names_it(self, cluster, files, tmp_path):
        bad = tmp_path / "bad.parquet"
        bad.write_bytes(b"not parquet")
        with pytest.raises(SourceError, match=r"bad\.parquet"):
            ShufflingDataset([*files, str(bad)], 1, 1, BATCH, 0)

    def test_file_broken_after_planning_names_it_when_read(self, cluster, files, tmp_path):
        broken = tmp_path / "broken.parquet"
        broken.write_bytes(pathlib.Path(files[0]).read_bytes())
        with ShufflingDataset([files[1], str(broken)], 1, 1, BATCH, 0, name=uuid.uuid4().hex) as ds:
            broken.write_bytes(b"garbage now")
            with pytest.raises(SourceError, match=r"broken\.parquet"):
                list(ds)

    def test_dead_trainer_fails_the_others_within_the_timeout(self, cluster, files):
        ranks = [ray.remote(num_cpus=0)(Trainer).remote() for _ in range(2)]
        args = {
            "num_epochs": 3,
            "num_trainers": 2,
            "batch_size": BATCH,
            "max_concurrent_epochs": 1,
            "timeout": 3.0,
            "name": uuid.uuid4().hex,
        }
        assert all(isinstance(n, int) for n in ray.get([t.open.remote(files, r, args) for r, t in enumerate(ranks)]))
        assert len(ray.get(ranks[1].read.remote([0], stop_after=1))[0]) == 1
        ray.kill(ranks[1])  # dies in the middle of epoch 0
        error = ray.get(ranks[0].read.remote([0, 1, 2]))
        assert error[0] == "LoaderTimeoutError" and "rank(s) [1]" in error[1], error
        ray.kill(ranks[0])

    def test_rank0_gone_fails_the_others(self, cluster, files):
        ranks = [ray.remote(num_cpus=0)(Trainer).remote() for _ in range(2)]
        args = {"num_epochs": 2, "num_trainers": 2, "batch_size": BATCH, "timeout": 20.0, "name": uuid.uuid4().hex}
        assert all(isinstance(n, int) for n in ray.get([t.open.remote(files, r, args) for r, t in enumerate(ranks)]))
        ray.kill(ranks[0])  # the batch queue lives in rank 0's process
        error = ray.get(ranks[1].read.remote([0, 1]))
        assert error[0] == "WorkerError" and "rank 0" in error[1], error
        ray.kill(ranks[1])

    def test_ranks_must_agree_on_the_arguments(self, cluster, files, trainers):
        name = uuid.uuid4().hex
        args = {"num_epochs": 1, "num_trainers": 2, "batch_size": BATCH, "name": name}
        assert isinstance(ray.get(trainers[0].open.remote(files, 0, args)), int)
        try:
            with pytest.raises(ArgumentError, match="differ from rank 0"):
                ShufflingDataset(files, 1, 2, BATCH * 2, 1, name=name, timeout=20)
        finally:
            ray.get(trainers[0].close.remote())

    @pytest.mark.parametrize(
        "bad",
        [
            {"num_epochs": 0},
            {"rank": 2},
            {"batch_size": "8"},
            {"num_reducers": 1},
            {"columns": "key"},
            {"timeout": -1},
            {"max_concurrent_epochs": 0},
            {"seed": 5 + 2**64},  # would share seed 5's order
        ],
    )
    def test_bad_arguments_name_themselves(self, files, bad):
        args = {"num_epochs": 1, "num_trainers": 2, "batch_size": BATCH, "rank": 0, **bad}
        with pytest.raises(ArgumentError, match=next(iter(bad))):
            ShufflingDataset(files, **args)

    def test_each_epoch_is_read_once_per_rank(self, cluster, files):
        with ShufflingDataset(files, 2, 1, BATCH, 0, name=uuid.uuid4().hex) as ds:
            ds.set_epoch(0)
            list(ds)
            ds.set_epoch(0)
            with pytest.raises(StateError, match="epoch 0"):
                iter(ds)

    def test_retried_calls_to_the_queue_are_answered_again_but_a_second_reader_is_refused(self, cluster, files):
        """A call whose answer was lost is sent again: the same take ticket, or the same rank's
        presence, gets the same answer; another ticket or another live process does not."""
        with ShufflingDataset(files, 2, 2, BATCH, 0, name=uuid.uuid4().hex) as ds:
            queue = ray.get_actor(ds.name, namespace=NAMESPACE)
            first, retried = (ray.get(queue.take.remote(0, 0, 30.0, "ticket-a")) for _ in range(2))
            assert first[0] == retried[0] == "ok" and len(first[1]["batch_sizes"]) == len(ds)
            assert all(np.array_equal(first[1][k], retried[1][k]) for k in ("batch_sizes", "reducer_batches"))
            status, message = ray.get(queue.take.remote(0, 0, 30.0, "ticket-b"))
            assert status == "error" and "already read epoch 0" in message
            again = ray.get(queue.attach.remote(0, ds.spec.key, ds._node, [ds._presence]))
            assert again == {"batches": len(ds), "rows": ds.total_rows}
            assert ray.get(queue.attach.remote(0, ds.spec.key, ds._node, [ray.put(0)])) == {"error": "attached"}


def test_mid_epoch_resume_continues_exactly(cluster, files):
    def make() -> ShufflingDataset:
        return ShufflingDataset(files, 1, 1, BATCH, 0, seed=3, num_reducers=3, name=uuid.uuid4().hex)

    full = check_resume(make, at=13)  # 13 batches: past the first reducer's outputs
    assert len(full) == -(-TOTAL // BATCH)


def test_fsspec_urls_and_iteration_without_set_epoch(cluster, files):
    with ShufflingDataset([f"file://{f}" for f in files], 2, 1, 64, 0, name=uuid.uuid4().hex) as ds:
        first, second = (np.concatenate([b["key"] for b in ds]) for _ in range(2))
        stats = ds.epoch_stats
    assert sorted(first) == sorted(second) == list(range(TOTAL))
    assert not np.array_equal(first, second)
    assert sorted(stats) == [0, 1]  # where time went, per epoch
    assert all(0 <= s["first_batch_s"] <= s["epoch_s"] and s["wait_s"] >= 0 for s in stats.values())


def test_torch_form_yields_feature_and_label_tensors(cluster, files):
    torch = pytest.importorskip("torch")
    from globalloader.ray.torch import TorchShufflingDataset

    with TorchShufflingDataset(
        files, 1, 1, BATCH, 0, feature_columns=["score", "payload"], label_column="key", name=uuid.uuid4().hex
    ) as ds:
        seen = []
        for features, label in ds:
            assert features.dtype == torch.float32 and label.dtype == torch.int64
            assert features.shape == (len(label), 1 + 8)
            assert torch.equal(features[:, 0], label.float() / 2)
            assert torch.equal(features[:, 1], (label % 251).float())
            seen.append(label)
    assert sorted(torch.cat(seen).tolist()) == list(range(TOTAL))
    with TorchShufflingDataset(
        files, 1, 1, BATCH, 0, feature_columns="payload", feature_types=torch.int16, name=uuid.uuid4().hex
    ) as ds:
        batch = next(iter(ds))
        assert batch.shape == (BATCH, 8) and batch.dtype == torch.int16
        with pytest.raises(ArgumentError, match="feature_types"):
            TorchShufflingDataset(
                files, 1, 1, BATCH, 0, feature_columns="payload", feature_types="int", name=uuid.uuid4().hex
            )


def test_without_ray_the_import_names_the_extra():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "try:\n    import globalloader.ray\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("MissingExtraError") and "globalloader[ray]" in out.stdout


def test_files_whose_column_types_differ_are_combined_only_without_a_change() -> None:
    from globalloader.ray.shuffle import _conform

    wide = np.array([1, 2], np.int64)
    assert _conform(np.array([3], np.int32), wide, "x", "b.parquet", "a.parquet").tolist() == [3]
    with pytest.raises(SourceError, match=r"column 'x' is int64 in b.parquet but int8 in a.parquet"):
        _conform(np.array([300], np.int64), np.array([1], np.int8), "x", "b.parquet", "a.parquet")
    assert _conform(np.array([2**53], np.int64), np.array([0.5]), "x", "b", "a").tolist() == [2.0**53]
    wrapping = [
        (np.array([2**53 + 1], np.int64), np.array([0.5])),  # NumPy calls this cast "safe"; it rounds
        (np.array([2**64 - 1], np.uint64), np.array([0.5])),
        (np.array(["9000-01-01"], "datetime64[D]"), np.array([1], "datetime64[ns]")),  # wraps to 1985
    ]
    for rows, like in wrapping:
        with pytest.raises(SourceError, match=r"in b but .* in a, which cannot hold some of its values"):
            _conform(rows, like, "x", "b", "a")


def test_integers_with_a_null_in_some_files_only_shuffle_as_float_whatever_the_order(cluster, tmp_path):
    """One file's integers hold a null (float64 with NaN, by the one Arrow rule), the other's none:
    every reducer takes the type both fit, so no epoch depends on which file a reducer got first."""
    pq.write_table(pa.table({"x": pa.array([0, 1, 2, None] * 25, pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array(np.arange(100, 200), pa.int64())}), tmp_path / "b.parquet")
    files = [str(tmp_path / "b.parquet"), str(tmp_path / "a.parquet")]  # the file without a null first
    with ShufflingDataset(files, 3, 1, 16, 0, num_reducers=4, name=uuid.uuid4().hex) as ds:
        for _ in range(3):
            values = np.concatenate([batch["x"] for batch in ds])
            assert values.dtype == np.float64
            assert np.isnan(values).sum() == 25
            assert sorted(values[~np.isnan(values)].tolist()) == sorted([0, 1, 2] * 25 + list(range(100, 200)))

"""A gl.Dataset's per-record operators run in Ray's map tasks: every epoch, the rows across the
trainers are exactly the chain's own (values and dtypes; only the order is Ray's)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader.dataset.collate import collate
from globalloader.errors import ArgumentTypeError, TransformError
from globalloader.ray import ShufflingDataset

pytestmark = pytest.mark.integration

ROWS = 300
EPOCHS = 2


def source() -> Any:
    records = [{"key": i, "x": np.full(3, i, np.float32), "name": f"row {i}"} for i in range(ROWS)]
    return gl.from_sequence(records)


def decode(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "x": r["x"] * 2}


def jitter(r: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {**r, "noise": rng.random()}


def keep(r: dict[str, Any], rng: np.random.Generator) -> bool:
    return bool(rng.random() < 0.6)  # a different set of rows every epoch


def split(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**r, "part": np.int16(j)} for j in range(r["key"] % 3)]  # none, one or two records


def crop(r: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {**r, "x": r["x"] + rng.integers(0, 100, 3).astype(np.float32)}


CHAINS = {
    "map and random map": lambda: gl.Dataset(source()).map(decode).map(jitter),
    "select with repeats": lambda: gl.Dataset(source()).select([5, 250, 5, *range(40, 120)]).map(jitter).seed(7),
    "random filter": lambda: gl.Dataset(source()).map(jitter).filter(keep),
    "flat_map then random map": lambda: gl.Dataset(source()).filter(keep).flat_map(split).map(crop).seed(3),
}


def rows_of(batches: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each row as a sortable tuple of its values and their dtypes."""
    out = []
    for batch in batches:
        names = sorted(batch)
        for i in range(len(batch[names[0]])):
            values = [np.asarray(batch[n][i]) for n in names]
            out.append(
                tuple(
                    (n, v.dtype.str, v.tobytes() if v.dtype != object else repr(v.item()))
                    for n, v in zip(names, values, strict=True)
                )
            )
    return sorted(out)


def run_all(chain: gl.Dataset, trainers: int = 2, **kwargs: Any) -> list[list[list[dict[str, Any]]]]:
    """Every rank in this process, epoch after epoch: [epoch][rank] -> batches."""
    name = uuid.uuid4().hex
    ranks = [ShufflingDataset(chain, EPOCHS, trainers, 16, r, name=name, **kwargs) for r in range(trainers)]
    try:
        return [[list(ds) for ds in ranks] for _ in range(EPOCHS)]
    finally:
        for ds in ranks[::-1]:
            ds.close()


@pytest.mark.parametrize("kind", list(CHAINS))
def test_each_epoch_holds_exactly_the_chains_rows(cluster, kind):
    chain = CHAINS[kind]()
    for epoch, ranks in enumerate(run_all(chain)):
        expected = list(chain.iterator(epoch))
        assert rows_of([b for batches in ranks for b in batches]) == rows_of([collate([r]) for r in expected])
        assert len({len(batches) for batches in ranks}) == 1  # equal batch counts per trainer
    if chain.plan.expands:  # the random filter keeps another set each epoch
        assert len(list(chain.iterator(0))) != len(list(chain.iterator(1)))


def test_a_chain_that_expands_has_a_length_per_epoch_only(cluster):
    chain = CHAINS["random filter"]()
    with ShufflingDataset(chain, 1, 1, 16, 0, name=uuid.uuid4().hex) as ds:
        with pytest.raises(ArgumentTypeError, match="filter or flat_map"):
            len(ds)
        batches = iter(ds)
        assert len(batches) == len(list(batches)) == -(-len(list(chain.iterator(0))) // 16)


def broken(r: dict[str, Any]) -> bool:
    if r["key"] == 77:
        raise ValueError("bad record")
    return True


def test_a_failing_map_reaches_the_trainer_as_the_loaders_error(cluster):
    chain = gl.Dataset(source()).filter(broken)
    with (
        ShufflingDataset(chain, 1, 1, 16, 0, name=uuid.uuid4().hex) as ds,
        pytest.raises(TransformError, match="'broken' failed on sample index 77: ValueError: bad record"),
    ):
        list(ds)

"""Every named random stream gives the order it was first pinned with: a seed keeps its order
across releases. The values below were taken before the streams moved into `_seeding`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import globalloader as gl
from globalloader._seeding import BUFFER_SHUFFLE, PERMUTATION, RAY_TABLE, WINDOW_BLOCKS, WINDOW_ROWS
from globalloader.ray.layout import make_layout, scatter_table
from globalloader.sampling import JointSampler
from globalloader.sampling.permutation import Permutation


def draw(x, rng):
    return int(rng.integers(1000))


def test_permutations_keep_their_orders():
    assert Permutation(12, seed=7, epoch=2).array().tolist() == [9, 10, 4, 11, 1, 2, 8, 6, 5, 0, 3, 7]
    feistel = Permutation(1 << 17, seed=7, epoch=2)[np.arange(8)].tolist()
    assert feistel == [42785, 114050, 2609, 9285, 98805, 106065, 64252, 118743]


def test_chain_streams_keep_their_orders(tmp_path):
    numbers = gl.from_sequence(list(range(12)))
    assert list(gl.Dataset(numbers).seed(5).shuffle().iterator(epoch=1)) == [7, 6, 8, 5, 10, 1, 9, 4, 0, 3, 2, 11]
    assert list(gl.Dataset(numbers).shuffle(seed=3).iterator(epoch=0)) == [10, 3, 4, 6, 1, 8, 2, 11, 9, 7, 0, 5]
    buffered = gl.Dataset.stream(list(range(12))).shuffle(seed=3, buffer_size=4).iterator(epoch=1)
    assert list(buffered) == [2, 0, 1, 3, 4, 5, 7, 6, 10, 11, 9, 8]
    mapped = gl.Dataset(gl.from_sequence(list(range(6)))).seed(4).map(draw).iterator(epoch=3)
    assert list(mapped) == [218, 174, 274, 793, 564, 33]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"x": list(range(30))}), path, row_group_size=3)
    windowed = [int(r["x"]) for r in gl.Dataset(gl.Parquet(str(path))).shuffle(seed=1, window=2).iterator(epoch=1)]
    assert windowed[:20] == [7, 6, 22, 8, 21, 23, 27, 12, 28, 13, 29, 14, 3, 2, 4, 1, 5, 0, 20, 25]
    assert windowed[20:] == [26, 24, 18, 19, 16, 15, 9, 11, 17, 10]


def test_joint_sampler_streams_keep_their_orders():
    alone = JointSampler(seed=9)
    alone.add_job("a", np.arange(10), seed=2, epoch=1)
    assert [alone.next("a") for _ in range(10)] == [4, 2, 3, 7, 0, 9, 8, 5, 1, 6]  # the job's plain order
    shared = JointSampler(seed=9)
    shared.add_job("a", np.arange(10), seed=2, epoch=1)
    shared.add_job("b", np.arange(10), seed=3, epoch=1)
    assert [shared.next("b") for _ in range(10)] == [1, 5, 3, 7, 6, 4, 2, 9, 8, 0]  # the sampler's own stream


def test_ray_table_keeps_its_draw():
    layout = make_layout(np.array([5, 7, 4]), 2, 2, 2, False)
    assert scatter_table(layout, 3, 1).tolist() == [[2, 3], [3, 4], [3, 1]]


def test_named_streams_are_distinct():
    names = [PERMUTATION, BUFFER_SHUFFLE, WINDOW_BLOCKS, WINDOW_ROWS]
    assert len(set(names)) == len(names) and RAY_TABLE not in names

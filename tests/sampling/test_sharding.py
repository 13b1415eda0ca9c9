from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import globalloader as gl
from globalloader.errors import ArgumentError
from globalloader.sampling.sharding import MAX_WORLD_SIZE


@given(
    n=st.integers(0, 300),
    world=st.integers(1, 6),
    workers=st.integers(1, 4),
    batch=st.integers(1, 9),
    seed=st.integers(0, 2**32),
    uneven=st.sampled_from(["pad", "drop", "none"]),
)
@settings(max_examples=80, deadline=None)
def test_every_index_once_across_ranks_and_workers(n, world, workers, batch, seed, uneven):
    seen = Counter()
    batch_counts = set()
    for rank in range(world):
        ds = gl.Dataset(list(range(n))).shuffle(seed).shard(rank, world, uneven).batch(batch)
        plan = ds.plan
        batch_counts.add(plan.num_tasks())
        for w in range(workers):
            for t in range(w, plan.num_tasks(), workers):  # the Loader's round-robin
                seen.update(int(i) for i in plan.task_indices(0, t))
    if uneven == "none":
        assert seen == Counter(range(n))
        return
    assert len(batch_counts) == 1, "ranks must get the same number of batches"
    if uneven == "drop":
        assert set(seen.values()) <= {1} and len(seen) == n - n % world
    else:
        # Padding repeats from the start of the order: every index, none more than once extra.
        assert set(seen) == set(range(n))
        assert sum(seen.values()) == (-(-n // world) * world if n else 0)
        assert not seen or max(seen.values()) - min(seen.values()) <= 1


def test_a_world_beyond_the_bound_a_state_can_hold_is_refused():
    assert len(gl.Dataset(list(range(4))).shard(MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE, "none")) == 0
    with pytest.raises(ArgumentError, match="world_size must be at most 1048576"):
        gl.Dataset(list(range(4))).shard(0, MAX_WORLD_SIZE + 1)

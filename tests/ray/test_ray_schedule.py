"""How map outputs are bundled for reducers (no cluster needed: no task is submitted)."""

from __future__ import annotations

import numpy as np
import pytest

from globalloader.ray.layout import make_layout, scatter_table
from globalloader.ray.schedule import ShuffleScheduler


@pytest.mark.parametrize("nodes", [{}, {0: "a", 1: "a"}, {0: "a", 1: "b"}, {0: "a"}])
def test_each_reducer_reads_its_own_disjoint_slice_of_one_map_output(nodes):
    layout = make_layout(np.array([900, 0, 1100, 700]), 2, 16, 12, False)
    scheduler = ShuffleScheduler([], None, lambda rows: layout, expands=True, num_reducers=12, seed=1, limit=3)
    scheduler.nodes.update(nodes)
    table = scatter_table(layout, seed=1, epoch=0)
    group_of, offset = scheduler._groups(table, layout)
    assert len(set(group_of.tolist())) <= max(4, len(set(nodes.values())))
    for g in set(group_of.tolist()):
        members = np.flatnonzero(group_of == g)
        ranks = {int(layout.reducer_rank[k]) for k in members}
        assert len({nodes.get(r, ("rank", r)) for r in ranks}) == 1  # one node per object
        for m in range(4):  # slices tile the group's object in reducer order
            starts, counts = offset[m, members], table[m, members]
            assert starts[0] == 0 and (starts[1:] == np.cumsum(counts)[:-1]).all()

"""The shuffle's plan, without Ray: batch sizes, reducer runs and the scatter table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalloader.errors import ArgumentError
from globalloader.ray.layout import default_num_reducers, make_layout, scatter_table

sizes = st.lists(st.integers(0, 400), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(sizes, st.integers(1, 4), st.integers(1, 50), st.integers(1, 4), st.booleans())
def test_every_trainer_gets_equal_batches_covering_the_epoch(file_rows, trainers, batch, per, drop_last):
    total = sum(file_rows)
    try:
        layout = make_layout(np.array(file_rows), trainers, batch, trainers * per, drop_last)
    except ArgumentError:
        assert total < (trainers * batch if drop_last else trainers)
        return
    sizes_ = layout.batch_sizes
    assert sizes_.shape[0] == trainers and (sizes_ > 0).all()
    if drop_last:
        assert (sizes_ == batch).all() and sizes_.shape[1] == total // (trainers * batch)
        assert layout.dropped == total - sizes_.sum()
    else:
        assert layout.dropped == 0 and sizes_.sum() == total
        assert (sizes_[:, :-1] == batch).all()  # only the last batch differs: the leftover
        assert (sizes_[:, -1] <= batch + 1).all() and np.ptp(sizes_[:, -1]) <= 1
    # Reducer runs tile each trainer's batches in order, without gaps or overlap.
    for rank in range(trainers):
        runs = layout.reducer_batches[layout.rank_reducers(rank)]
        assert runs[0, 0] == 0 and runs[-1, 1] == sizes_.shape[1]
        assert (runs[1:, 0] == runs[:-1, 1]).all() and (runs[:, 1] > runs[:, 0]).all()
    assert layout.reducer_rows.sum() == total - layout.dropped


def test_leftover_rows_are_split_evenly_and_never_leave_an_empty_batch():
    even = make_layout(np.array([10 * 8 + 6]), 2, 8, 2, False)  # 5 rounds of 16, 6 left
    assert even.batch_sizes[:, -1].tolist() == [3, 3] and even.num_batches == 6
    tiny = make_layout(np.array([2 * 8 * 4 + 1]), 2, 8, 2, False)  # 1 left for 2 trainers
    assert tiny.num_batches == 4 and tiny.batch_sizes.sum() == 65
    assert tiny.batch_sizes[:, -1].tolist() == [9, 8]  # folded into a full batch, none empty


def test_too_few_rows_is_an_argument_error():
    with pytest.raises(ArgumentError, match="fewer than num_trainers"):
        make_layout(np.array([1]), 2, 8, 2, False)
    with pytest.raises(ArgumentError, match="drop_last=True"):
        make_layout(np.array([15]), 2, 8, 2, True)


def test_reducers_come_round_by_round_across_trainers():
    layout = make_layout(np.array([1000]), 2, 10, 6, False)
    assert layout.reducer_rank.tolist() == [0, 1, 0, 1, 0, 1]


@settings(max_examples=100, deadline=None)
@given(sizes, st.integers(1, 3), st.integers(1, 20), st.booleans(), st.integers(0, 3))
def test_scatter_table_margins_match_files_and_reducers(file_rows, trainers, batch, drop_last, epoch):
    try:
        layout = make_layout(np.array(file_rows), trainers, batch, trainers * 2, drop_last)
    except ArgumentError:
        return
    table = scatter_table(layout, seed=7, epoch=epoch)
    assert (table >= 0).all()
    assert (table.sum(axis=0) == layout.reducer_rows).all()
    assert table.sum() == sum(file_rows) - layout.dropped
    assert (table.sum(axis=1) <= np.array(file_rows)).all()
    assert (table == scatter_table(layout, seed=7, epoch=epoch)).all()


def test_scatter_table_is_a_fair_random_split():
    """Each reducer draws from every file in proportion to its rows (hypergeometric mean)."""
    layout = make_layout(np.array([4000, 2000, 2000]), 2, 100, 4, False)
    tables = np.stack([scatter_table(layout, seed=0, epoch=e) for e in range(40)])
    share = tables.mean(axis=0) / layout.reducer_rows  # expected 0.5, 0.25, 0.25 per reducer
    assert np.allclose(share, np.array([[0.5], [0.25], [0.25]]), atol=0.02)
    assert not (tables[0] == tables[1]).all()  # epochs differ


def test_default_reducer_count_depends_on_data_only():
    assert default_num_reducers(64, 2) == 16
    assert default_num_reducers(3, 2) == 2
    assert default_num_reducers(10_000, 4) == 32

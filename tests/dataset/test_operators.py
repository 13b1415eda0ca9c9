"""What each chain operator makes: filter, flat_map, concat, mix, zip, padded and bucketed
batches, pack, and the seed that roots them (resuming is checked in test_resume.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import globalloader as gl
from globalloader.dataset.select import Select
from globalloader.dataset.shard import Shard
from globalloader.dataset.shuffle import Shuffle, WindowShuffle
from globalloader.errors import ArgumentError, StateError, TransformError


def numbers(n: int, start: int = 0) -> gl.Dataset:
    return gl.Dataset(gl.from_sequence(list(range(start, start + n))))


def tokens(lengths: list[int]) -> gl.Dataset:
    docs = [{"tokens": np.arange(n, dtype=np.int32) + 1000 * i} for i, n in enumerate(lengths)]
    return gl.Dataset(gl.from_sequence(docs, key=f"docs-{lengths}"))


def draw(x, rng):
    return (x, float(rng.random()))


# -- index operators: what the plan asks of each (IndexOp) -------------------------------------
INDEX_OPS = {
    "select": Select.of(np.random.default_rng(0).permutation(103)[:60]),
    "shuffle": Shuffle(3),
    "window_shuffle": WindowShuffle(5, 2, np.array([0, 10, 30, 31, 70, 103])),
    "shard pad": Shard(1, 4, "pad"),
    "shard drop": Shard(3, 4, "drop"),
    "shard none": Shard(2, 4, "none"),
}


@pytest.mark.parametrize("name", list(INDEX_OPS))
def test_every_index_operator_keeps_what_the_plan_relies_on(name: str) -> None:
    """The plan asks an index operator only what `IndexOp` declares: a task's run maps as its
    positions do (and is the caller's to keep), `per_epoch` says whether the map changes with
    the epoch, and only a shard names a rank's share (which the elastic resume splits anew)."""
    op, n = INDEX_OPS[name], 103
    m = op.length(n)
    rng = np.random.default_rng(7)
    runs = [(0, m), (0, 1), (m - 1, m), (m, m), *(sorted(rng.integers(0, m + 1, 2).tolist()) for _ in range(30))]
    for epoch in (0, 1):
        for start, stop in runs:
            run = op.parents_run(start, stop, n, epoch)
            assert np.array_equal(run, op.parents(np.arange(start, stop, dtype=np.int64), n, epoch)), (epoch, start)
            run[:] = -1
        assert op.parents_run(0, m, n, epoch).min() >= 0
    whole = np.arange(m, dtype=np.int64)
    assert op.per_epoch == (not np.array_equal(op.parents(whole, n, 0), op.parents(whole, n, 1)))
    assert op.shard_args() is (op if isinstance(op, Shard) else None)


# -- filter and flat_map -------------------------------------------------------------------------
def test_filter_keeps_exactly_the_accepted_samples_in_chain_order():
    chain = numbers(50).shuffle(seed=3)
    kept = list(chain.filter(lambda x: x % 3 == 0))
    assert kept == [x for x in chain if x % 3 == 0]
    batches = list(chain.filter(lambda x: x % 3 == 0).batch(4))
    assert [len(b) for b in batches] == [4, 4, 4, 4, 1]  # batches cut across tasks, only the last short
    assert np.concatenate(batches).tolist() == kept


def test_flat_map_makes_any_number_of_records_in_order_with_their_own_rng():
    chain = numbers(40).flat_map(lambda x: [x] * (x % 3)).map(draw)
    out = list(chain)
    assert [x for x, _ in out] == [x for x in range(40) for _ in range(x % 3)]
    draws = [r for _, r in out]
    assert len(set(draws)) == len(draws)  # each made record gets its own generator
    assert out == list(chain)  # and the same one every time


def test_a_flat_map_returning_a_non_iterable_is_a_sample_error_that_skip_skips():
    chain = numbers(10).flat_map(lambda x: x if x == 4 else [x])
    with pytest.raises(TransformError, match="iterable"):
        list(chain)
    with pytest.warns(UserWarning, match="skipped"), gl.Loader(chain, on_error="skip") as loader:
        assert list(loader) == [x for x in range(10) if x != 4]


def test_filter_before_a_shuffle_is_refused_where_written():
    with pytest.raises(ArgumentError, match="before batch, filter"):
        numbers(10).filter(bool).shuffle()


def test_a_chain_that_filters_has_no_length_before_it_runs():
    with pytest.raises(TypeError, match="no length known"):
        len(numbers(10).filter(bool))


# -- concat, mix, zip ----------------------------------------------------------------------------
def test_concat_reads_every_part_once_and_shuffles_across_them():
    chain = gl.Dataset.concat([numbers(7), numbers(5, start=100)])
    assert list(chain) == list(range(7)) + list(range(100, 105))
    shuffled = list(chain.shuffle(seed=1))
    assert sorted(shuffled) == sorted(chain) and shuffled != list(chain)


def test_mix_has_exact_proportions_and_stops_when_a_part_runs_out():
    a, b = numbers(700), numbers(1000, start=10_000)
    out = list(gl.Dataset.mix([a, b], [0.7, 0.3]))
    from_a = [x for x in out if x < 10_000]
    assert len(out) == 1000 and len(from_a) == 700  # a runs out: the epoch ends, no repeats
    assert len(set(out)) == len(out)
    for end in (10, 100, 333, 1000):  # smooth: every prefix is within one sample of 70/30
        assert abs(sum(x < 10_000 for x in out[:end]) - 0.7 * end) <= 1


def test_mix_cycle_restarts_short_parts_in_a_fresh_order_until_all_were_read():
    a, b = numbers(30).shuffle(), numbers(4, start=100).shuffle()
    out = list(gl.Dataset.mix([a, b], [0.5, 0.5], on_exhausted="cycle"))
    assert Counter(x for x in out if x < 100) == Counter(range(30))  # the long part once
    small = [x for x in out if x >= 100]
    assert len(small) == 30 and sorted(Counter(small).values()) == [7, 7, 8, 8]
    rounds = [small[i : i + 4] for i in range(0, 28, 4)]
    assert all(sorted(r) == [100, 101, 102, 103] for r in rounds)  # each round is a permutation
    assert len({tuple(r) for r in rounds}) > 1  # in a fresh order


def test_zip_pairs_positions_and_is_as_long_as_the_shortest():
    out = list(gl.Dataset.zip([numbers(5), numbers(3, start=10)]))
    assert out == [(0, 10), (1, 11), (2, 12)]


def test_mixing_parts_that_filter_or_batch_is_refused_naming_the_part():
    with pytest.raises(ArgumentError, match="part 1"):
        gl.Dataset.mix([numbers(5), numbers(5).batch(2)], [0.5, 0.5])
    with pytest.raises(ArgumentError, match="weights"):
        gl.Dataset.mix([numbers(5), numbers(5)], [1.0, -1.0])
    with pytest.raises(ArgumentError, match="on_exhausted"):
        gl.Dataset.mix([numbers(5), numbers(5)], [1, 1], on_exhausted="never")
    with pytest.raises(ArgumentError, match=r"list of gl\.Dataset"):
        gl.Dataset.concat([list(range(3))])


def test_parts_draw_from_their_own_streams_under_the_mix_seed():
    part = numbers(10).map(draw)
    mixed = gl.Dataset.mix([part, part], [0.5, 0.5])
    out = list(mixed.seed(1))
    first = [r for _, r in out[0::2]]
    second = [r for _, r in out[1::2]]
    assert first != second  # the same chain twice: not the same draws
    assert out != list(mixed.seed(2)) and out == list(mixed.seed(1))


# -- padded and bucketed batches ---------------------------------------------------------------
def test_batch_pad_pads_to_the_longest_in_the_batch_and_keeps_every_token():
    lengths = [3, 1, 4, 1, 5]
    (batch,) = list(tokens(lengths).batch(5, pad={"tokens": -1}))
    assert batch["tokens"].shape == (5, 5)
    for row, n in zip(batch["tokens"], lengths, strict=True):
        assert (row[n:] == -1).all() and (row[:n] >= 0).all()


def test_batch_pad_with_a_custom_collate_is_refused():
    with pytest.raises(ArgumentError, match="pad="):
        numbers(4).batch(2, collate=list, pad=0)


def test_bucket_batch_puts_each_length_in_its_bucket_and_batches_every_sample_once():
    lengths = [int(x) for x in np.random.default_rng(1).integers(1, 30, size=120)]
    docs = [{"n": np.int64(n), "tokens": np.full(n, 7, dtype=np.int32)} for n in lengths]
    chain = gl.Dataset(gl.from_sequence(docs, key="bucket-docs")).bucket_batch(
        lambda r: int(r["n"]), boundaries=[10, 20], batch_size=[8, 4, 2], pad=0
    )
    sizes = Counter()
    for batch in chain:
        buckets = set(np.digitize(batch["n"], [10, 20]).tolist())
        assert len(buckets) == 1  # one bucket per batch
        (b,) = buckets
        assert len(batch["n"]) <= [8, 4, 2][b]
        assert batch["tokens"].shape[1] == batch["n"].max()  # padded to the batch's longest only
        sizes[b] += len(batch["n"])
    assert sum(sizes.values()) == 120
    assert sizes == Counter(np.digitize(lengths, [10, 20]).tolist())


def test_bucket_batch_arguments_are_checked():
    with pytest.raises(ArgumentError, match="increasing"):
        numbers(3).bucket_batch(int, [5, 2], 4)
    with pytest.raises(ArgumentError, match="3 buckets"):
        numbers(3).bucket_batch(int, [2, 5], [4, 4])


# -- pack --------------------------------------------------------------------------------------
def test_pack_keeps_every_token_in_order_with_segments_and_positions():
    lengths = [int(x) for x in np.random.default_rng(2).lognormal(2, 1.2, size=60).astype(int)]
    rows = list(tokens(lengths).pack(16))
    flat = np.concatenate([r["tokens"][r["segment_ids"] > 0] for r in rows])
    expected = np.concatenate([np.arange(n, dtype=np.int32) + 1000 * i for i, n in enumerate(lengths)])
    assert flat.dtype == np.int32 and np.array_equal(flat, expected)  # nothing dropped, nothing reordered
    assert all(r["tokens"].shape == (16,) for r in rows)
    assert all((r["segment_ids"] > 0).all() for r in rows[:-1])  # only the last row is padded
    for r in rows:  # a segment is one document's piece: positions count from 0 inside it
        for s in set(r["segment_ids"].tolist()) - {0}:
            piece = r["tokens"][r["segment_ids"] == s]
            assert len(set((piece // 1000).tolist())) == 1
            assert r["positions"][r["segment_ids"] == s].tolist() == list(range(len(piece)))


def test_pack_refuses_records_without_a_token_array():
    with pytest.raises(TransformError, match="no token array at key 'tokens'"):
        list(numbers(3).map(lambda x: {"ids": np.arange(3)}).pack(4))
    with pytest.raises(TransformError, match="1-D integer"):
        list(numbers(3).map(lambda x: {"tokens": np.ones(3)}).pack(4))


def test_pack_then_batch_and_drop_last():
    chain = tokens([5, 5, 5]).pack(4, drop_last=True).batch(2)
    out = list(chain)
    assert [b["tokens"].shape for b in out] == [(2, 4), (1, 4)]  # 15 tokens: 3 full rows, the rest dropped


def test_pack_after_batch_is_refused():
    with pytest.raises(ArgumentError, match="pack must come before batch"):
        tokens([3]).batch(2).pack(4)


# -- seeds -------------------------------------------------------------------------------------
def test_the_shuffle_seed_no_longer_seeds_random_maps():
    a = list(numbers(20).shuffle(seed=1).map(draw))
    b = list(numbers(20).shuffle(seed=2).map(draw))
    assert dict(a) == dict(b)  # same sample, same draw: the maps are rooted in seed(), not the shuffle


def test_seed_roots_shuffles_and_maps_and_a_chain_without_shuffle_still_draws_per_sample():
    plain = list(numbers(20).map(draw))
    assert len({r for _, r in plain}) == 20
    assert list(numbers(20).seed(5).map(draw)) != plain
    assert list(numbers(20).seed(5).shuffle()) != list(numbers(20).seed(6).shuffle())
    assert list(numbers(20).seed(5).shuffle()) == list(numbers(20).shuffle().seed(5))  # wherever written


def test_two_shuffles_and_two_maps_draw_distinct_streams():
    chain = numbers(64).seed(1).map(draw).map(lambda p, rng: (*p, float(rng.random())))
    assert all(a != b for _, a, b in chain)


def test_seed_twice_is_refused_and_a_state_dict_of_another_seed_is_foreign():
    with pytest.raises(ArgumentError, match="once"):
        numbers(5).seed(1).seed(2)
    it = numbers(5).seed(1).shuffle().iterator()
    next(it)
    other = numbers(5).seed(2).shuffle().iterator()
    with pytest.raises(StateError, match="different chain"):
        other.load_state_dict(it.state_dict())

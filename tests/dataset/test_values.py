"""No value is changed silently: collate, pad, pack, mix, bucket_batch, zip and concat either keep
every value exactly or raise a named error (property tests over dtypes, shapes and edge inputs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import globalloader as gl
from globalloader.dataset.collate import collate
from globalloader.errors import ArgumentError, TransformError

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
DTYPES = [*INT_DTYPES, "float16", "float32", "float64", "bool"]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def arrays(draw: Any, dtypes: list[str] = DTYPES, shape: tuple[int, ...] | None = None) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    size = shape if shape is not None else (draw(st.integers(0, 5)),)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = st.integers(int(info.min), int(info.max))
    elif dtype.kind == "f":
        values = st.floats(width=dtype.itemsize * 8, allow_nan=True, allow_infinity=True)
    else:
        values = st.booleans()
    flat = draw(st.lists(values, min_size=int(np.prod(size)), max_size=int(np.prod(size))))
    return np.array(flat, dtype=dtype).reshape(size)


def same(a: Any, b: Any) -> bool:
    """Equal as Python values (ints compared exactly, NaN equal to NaN, bool to its int)."""
    a, b = np.asarray(a).tolist(), np.asarray(b).tolist()
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)


def attempt(make: Any) -> tuple[Any, Exception | None]:
    """What `make()` returns, or the named error it raised (asserted on by the caller)."""
    try:
        return make(), None
    except (ArgumentError, TransformError) as exc:
        return None, exc


def stacked(batch: Any) -> np.ndarray:
    """A `Stacked` deferred batch filled as the transport fills it, or the array itself."""
    if isinstance(batch, np.ndarray):
        return batch
    out = np.empty(batch.shape, batch.dtype)
    batch.stack_into(out)
    return out


# -- collate and pad -----------------------------------------------------------------------------------
@PROPERTY
@given(st.data(), st.integers(1, 4), st.integers(0, 4), st.booleans())
def test_collated_arrays_hold_every_value_or_raise(data: Any, n: int, length: int, deferred: bool) -> None:
    items = [data.draw(arrays(shape=(length,))) for _ in range(n)]
    out, error = attempt(lambda: stacked(collate(items, deferred=deferred)))
    if error is not None:
        assert isinstance(error, ArgumentError) and "batch" in str(error)  # names the field
        return
    assert out.shape == (n, length)
    assert out.dtype == np.result_type(*items)
    assert all(same(row, item) for row, item in zip(out, items, strict=True))


@PROPERTY
@given(st.data(), st.integers(1, 4), st.one_of(st.integers(-(2**65), 2**65), st.floats()))
def test_padded_batches_keep_values_and_pad_or_raise(data: Any, n: int, pad: Any) -> None:
    items = [data.draw(arrays()) for _ in range(n)]
    batches, error = attempt(lambda: list(gl.Dataset(gl.from_sequence(items, key="v")).batch(n, pad=pad)))
    if error is not None:
        assert isinstance(error, ArgumentError) and ("pad" in str(error) or "mixes" in str(error))
        return
    (batch,) = batches
    for row, item in zip(batch, items, strict=True):
        assert same(row[: len(item)], item)
        filler = row[len(item) :]
        assert all(same(x, np.array(pad).astype(batch.dtype)) for x in filler)
        if batch.dtype.kind in "iub":
            assert all(x == pad for x in filler.tolist())  # integers: the pad itself, never wrapped


@PROPERTY
@given(
    st.lists(
        st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.booleans(), st.text(max_size=2), st.binary(max_size=2)),
        min_size=1,
        max_size=5,
    )
)
def test_collated_python_values_stay_what_they_are(values: list[Any]) -> None:
    out, error = attempt(lambda: collate(values))
    if error is not None:
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        return
    if isinstance(out, list):
        assert out == values
    else:
        got = out.tolist()  # Python compares ints and floats exactly: 2**53 + 1 != 2.0**53
        assert all(x == y or (x != x and y != y) for x, y in zip(got, values, strict=True))
        assert len({type(v) for v in values}) <= 2  # ints and floats only mix


def test_the_reported_conversions_are_gone() -> None:
    assert collate([1, "a"]) == [1, "a"] and collate(["a", 1]) == ["a", 1]
    assert collate([True, 2]) == [True, 2]
    int8, int64 = np.array([1, 2], np.int8), np.array([300, 40000, 70000], np.int64)
    (batch,) = list(gl.Dataset(gl.from_sequence([int8, int64], key="w")).batch(2, pad=0))
    assert batch.tolist() == [[1, 2, 0], [300, 40000, 70000]]
    with pytest.raises(ArgumentError, match=r"batch mixes uint64 and int64"):
        collate([np.array([2**63], np.uint64), np.array([-1])])
    with pytest.raises(ArgumentError, match=r"batch\['x'\] mixes <U1 and int64"):
        collate([{"x": np.array(["a"])}, {"x": np.array([1])}])
    with pytest.raises(ArgumentError, match=r"cannot hold some of its values exactly"):
        collate([2**60 + 1, 0.5])
    with pytest.raises(ArgumentError, match=r"pad=300 does not fit batch's dtype int8"):
        collate([np.array([1], np.int8), np.array([1, 2], np.int8)], pad=300)
    with pytest.raises(ArgumentError, match=r"pad=0.5 does not fit"):
        collate([np.array([1]), np.array([1, 2])], pad=0.5)


def test_collate_refuses_the_promotions_that_wrap_or_decode() -> None:
    """Found in review: a promotion that NumPy allows but that changes a value."""
    far_date, one_ns = np.array(["9000-01-01"], "datetime64[D]"), np.array([1], "datetime64[ns]")
    with pytest.raises(ArgumentError, match=r"batch mixes datetime64\[D\] with datetime64\[ns\]"):
        collate([far_date, one_ns])  # NumPy: 1985-05-09 in nanoseconds
    with pytest.raises(ArgumentError, match=r"timedelta64\[s\] with timedelta64\[ns\]"):
        collate([np.timedelta64(2**62, "s"), np.timedelta64(1, "ns")])  # NumPy scalars: 0 ns
    near = collate([np.array(["2020-01-02"], "datetime64[D]"), one_ns])
    assert near.dtype == np.dtype("datetime64[ns]") and str(near[0, 0]) == "2020-01-02T00:00:00.000000000"
    record, floats = np.zeros(1, [("a", "i8")]), np.zeros(1, [("a", "f4")])
    record["a"] = 2**60 + 1
    with pytest.raises(ArgumentError, match=r"batch mixes \[\('a', '<i8'\)\] with \[\('a', '<f8'\)\]"):
        collate([record, floats])  # the field would become a float64
    with pytest.raises(ArgumentError, match=r"batch mixes <U1 and \|S3"):
        collate([np.array(["a"]), np.array([b"bbb"])])  # bytes would be decoded (or raise on b"\\xff")
    with pytest.raises(ArgumentError, match=r"pad=1j does not fit batch's dtype float64"):
        collate([np.array([1.0]), np.array([1.0, 2.0])], pad=1j)  # the imaginary part would be dropped
    assert collate([2**64 - 1, 0]).dtype == np.uint64  # NumPy makes them float64
    with pytest.raises(ArgumentError, match=r"batch mixes uint64 and int64"):
        collate([2**63, -1])  # no integer type holds both
    masked = np.ma.array([1, 2], mask=[False, True])
    kept = collate([masked, np.ma.array([3, 4])])
    assert isinstance(kept, list) and kept[0].mask.tolist() == [False, True]  # a stack drops the mask
    assert collate([np.array([1], ">i4"), np.array([2], "<i4")]).tolist() == [[1], [2]]


def _tensor_sample(i: int) -> dict[str, Any]:
    import torch

    return {
        "ids": torch.tensor([i, 300 * i], dtype=torch.int8 if i % 2 == 0 and i < 1 else torch.int64),
        "half": torch.tensor([i + 0.5], dtype=torch.bfloat16),  # NumPy has no bfloat16
        "flipped": torch.tensor([i + 1j]).conj(),  # a lazy conjugate: .numpy() refuses it
    }


def test_tensors_of_any_dtype_collate_exactly_through_process_workers() -> None:
    torch = pytest.importorskip("torch")
    ds = gl.Dataset(gl.from_sequence(list(range(8)))).map(_tensor_sample).batch(4)
    with gl.Loader(ds, workers=2, start_method="fork") as loader:
        batches = list(loader)
    assert [b["ids"].tolist() for b in batches] == [[[i, 300 * i] for i in range(k, k + 4)] for k in (0, 4)]
    assert all(b["ids"].dtype == np.int64 for b in batches)  # int8 (i = 0) with int64: int64
    halves = [t for b in batches for t in b["half"]]
    assert all(t.dtype == torch.bfloat16 for t in halves) and [float(t) for t in halves] == [i + 0.5 for i in range(8)]
    assert [complex(x) for b in batches for x in b["flipped"].ravel()] == [i - 1j for i in range(8)]


# -- pack -----------------------------------------------------------------------------------------------
@PROPERTY
@given(
    st.data(),
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.integers(1, 8),
    st.sampled_from([None, *INT_DTYPES]),
    st.integers(-(2**40), 2**40),
)
def test_pack_keeps_every_token_or_raises(
    data: Any, lengths: list[int], seq_len: int, dtype: str | None, pad: int
) -> None:
    docs = [data.draw(arrays(INT_DTYPES, shape=(n,))) for n in lengths]
    chain = gl.Dataset(gl.from_sequence([{"tokens": d} for d in docs], key="docs"))
    rows, error = attempt(lambda: list(chain.pack(seq_len, pad=pad, dtype=dtype)))
    if isinstance(error, ArgumentError):
        assert "pad" in str(error) or "mixes" in str(error)
        return
    if error is not None:
        assert dtype is not None and "cannot hold" in str(error)
        return
    pairs = [(t, s) for row in rows for t, s in zip(row["tokens"].tolist(), row["segment_ids"], strict=True)]
    assert [t for t, s in pairs if s > 0] == [t for d in docs for t in d.tolist()]
    assert all(t == pad for t, s in pairs if s == 0)
    if dtype is not None:
        assert all(row["tokens"].dtype == np.dtype(dtype) for row in rows)


def test_pack_of_an_int8_then_an_int64_document_keeps_the_values() -> None:
    docs = [{"tokens": np.array([1, 2, 3], np.int8)}, {"tokens": np.array([300, 40000, 70000], np.int64)}]
    (row,) = list(gl.Dataset(gl.from_sequence(docs, key="d")).pack(6))
    assert row["tokens"].tolist() == [1, 2, 3, 300, 40000, 70000] and row["tokens"].dtype == np.int64
    with pytest.raises(TransformError, match=r"tokens 300\.\.70000 that dtype int16 cannot hold"):
        list(gl.Dataset(gl.from_sequence(docs, key="d")).pack(6, dtype=np.int16))
    with pytest.raises(ArgumentError, match=r"pad=-1 does not fit dtype uint16"):
        gl.Dataset(gl.from_sequence(docs, key="d")).pack(6, pad=-1, dtype="uint16")
    with pytest.raises(ArgumentError, match=r"pad=1000 does not fit the 'tokens' dtype int8"):
        list(gl.Dataset(gl.from_sequence(docs[:1], key="d")).pack(4, pad=1000))
    with pytest.raises(ArgumentError, match=r"dtype must be an integer NumPy dtype"):
        gl.Dataset(gl.from_sequence(docs, key="d")).pack(6, dtype="float32")


def test_pack_takes_empty_documents_of_any_dtype() -> None:
    docs = [{"tokens": []}, {"tokens": np.array([1, 2, 3], np.int16)}, {"tokens": np.array([], np.float64)}]
    rows = list(gl.Dataset(gl.from_sequence(docs)).pack(2))
    assert [(r["tokens"].tolist(), r["tokens"].dtype) for r in rows] == [([1, 2], np.int16), ([3, 0], np.int16)]
    with pytest.raises(TransformError, match=r"must be a 1-D integer array, got float64 of shape \(1,\)"):
        list(gl.Dataset(gl.from_sequence([{"tokens": [1.5]}])).pack(2))


def test_mixed_corpora_of_two_dtypes_pack_exactly_through_workers() -> None:
    """The reported case: mix(uint16 corpus, int32 corpus).pack(16).batch(4), 2 workers."""
    rng = np.random.default_rng(0)
    small = [{"tokens": rng.integers(0, 2**16, size=7, dtype=np.uint16)} for _ in range(30)]
    large = [{"tokens": rng.integers(2**16, 2**20, size=5, dtype=np.int32)} for _ in range(30)]
    parts = [gl.Dataset(gl.from_sequence(c, key=k)) for c, k in ((small, "u16"), (large, "i32"))]
    chain = gl.Dataset.mix(parts, weights=[0.5, 0.5]).seed(0).pack(16).batch(4)
    with gl.Loader(chain, workers=2) as loader:
        batches = list(loader)
    tokens = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches]).tolist()
    assert sorted(tokens) == sorted(t for doc in small + large for t in doc["tokens"].tolist())
    assert all(b["tokens"].dtype == np.int32 for b in batches)


# -- mix, concat, zip -----------------------------------------------------------------------------------
@PROPERTY
@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=4),
    st.data(),
    st.sampled_from(["stop", "cycle"]),
)
def test_mix_reads_only_its_parts_and_never_fills(sizes: list[int], data: Any, on_exhausted: str) -> None:
    weights = data.draw(
        st.lists(
            st.one_of(st.floats(min_value=0.01, max_value=100), st.integers(1, 10)),  # extremes: below
            min_size=len(sizes),
            max_size=len(sizes),
        )
    )
    parts = [gl.Dataset(gl.from_sequence([(k, i) for i in range(n)], key=f"p{k}")) for k, n in enumerate(sizes)]
    out, error = attempt(lambda: list(gl.Dataset.mix(parts, weights=weights, on_exhausted=on_exhausted)))
    if error is not None:
        assert isinstance(error, ArgumentError) and "no samples" in str(error) and 0 in sizes
        return
    assert 0 not in sizes
    valid = {(k, i) for k, n in enumerate(sizes) for i in range(n)}
    assert set(out) <= valid
    if on_exhausted == "stop":
        assert len(out) == len(set(out))  # no repeats
    else:
        assert set(out) == valid  # every part read once at least


@pytest.mark.parametrize(
    "weights",
    [[float("inf"), 1], [float("nan"), 1], ["a", 1], None, [1, None], [True, 1], [0, 1], [-1, 1], [1], "ab"],
)
def test_mix_refuses_weights_that_are_not_finite_positive_numbers(weights: Any) -> None:
    part = gl.Dataset(gl.from_sequence(list(range(10))))
    with pytest.raises(ArgumentError, match=r"mix: weights must be 2 finite numbers > 0"):
        gl.Dataset.mix([part, part], weights=weights)


def test_mix_edge_weights_and_empty_parts() -> None:
    part = gl.Dataset(gl.from_sequence(list(range(10))))
    empty = gl.Dataset(gl.from_sequence([]))
    assert len(gl.Dataset.mix([part, part], weights=[1e308, 1e308])) == 20  # huge but equal: an even mix
    with pytest.raises(ArgumentError, match=r"make an epoch of 10,000,000,010 samples"):
        len(gl.Dataset.mix([part, part], weights=[1, 1e-9], on_exhausted="cycle"))
    for on_exhausted in ("stop", "cycle"):
        with pytest.raises(ArgumentError, match=r"mix: part 1 .* has no samples"):
            list(gl.Dataset.mix([part, empty], weights=[1, 1], on_exhausted=on_exhausted))


@PROPERTY
@given(st.lists(st.integers(0, 8), min_size=1, max_size=4))
def test_concat_and_zip_are_their_parts_exactly(sizes: list[int]) -> None:
    parts = [gl.Dataset(gl.from_sequence([(k, i) for i in range(n)], key=f"p{k}")) for k, n in enumerate(sizes)]
    assert list(gl.Dataset.concat(parts)) == [(k, i) for k, n in enumerate(sizes) for i in range(n)]
    assert list(gl.Dataset.zip(parts)) == [tuple((k, i) for k in range(len(sizes))) for i in range(min(sizes))]


# -- bucket_batch ---------------------------------------------------------------------------------------
@PROPERTY
@given(
    st.lists(st.one_of(st.integers(-5, 40), st.floats(allow_infinity=False)), min_size=0, max_size=30),
    st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True),
    st.integers(1, 4),
)
def test_bucket_batch_puts_every_sample_in_exactly_one_batch(lengths: list[Any], bounds: list[int], size: int) -> None:
    samples = [(i, length) for i, length in enumerate(lengths)]
    chain = gl.Dataset(gl.from_sequence(samples, key="s")).bucket_batch(lambda s: s[1], sorted(bounds), size)
    batches, error = attempt(lambda: list(chain))
    if error is not None:
        assert any(x != x for x in lengths) and "must return a number, got nan" in str(error)
        return
    seen = [int(i) for b in batches for i in b[0]]
    assert sorted(seen) == list(range(len(lengths)))
    for b in batches:
        buckets = {int(np.searchsorted(sorted(bounds), float(length), side="right")) for length in b[1]}
        assert len(buckets) == 1


@pytest.mark.parametrize("length", ["3", None, float("nan"), True, [3]])
def test_bucket_batch_refuses_a_length_that_is_not_a_number(length: Any) -> None:
    chain = gl.Dataset(gl.from_sequence(list(range(4)))).bucket_batch(lambda x: length, [2], 2)
    with pytest.raises(TransformError, match=r"length_fn must return a number, got"):
        list(chain)


@pytest.mark.parametrize("boundaries", [None, "12", [2, 1], [1.5], [True], []])
def test_bucket_batch_refuses_bad_boundaries(boundaries: Any) -> None:
    with pytest.raises(ArgumentError, match=r"bucket_batch: boundaries must be a list of increasing ints"):
        gl.Dataset(gl.from_sequence(list(range(4)))).bucket_batch(len, boundaries, 2)


@pytest.mark.parametrize("indices", [[1.5], [True, False], ["1"], "3", np.array([2**63], np.uint64)])
def test_select_takes_only_integers(indices: Any) -> None:
    with pytest.raises(ArgumentError, match=r"select: indices must be integers"):
        gl.Dataset(gl.from_sequence(list(range(10)))).select(indices)
    assert list(gl.Dataset(gl.from_sequence(list(range(10)))).select(np.array([3, 1], np.uint8))) == [3, 1]


def test_select_takes_a_flat_list_only() -> None:
    with pytest.raises(ArgumentError, match=r"select: indices must be a flat list of integers, got .* shape \(2, 2\)"):
        gl.Dataset(gl.from_sequence(list(range(10)))).select([[1, 2], [3, 4]])  # was flattened to 1, 2, 3, 4


def test_numpy_integers_count_as_ints_and_arrays_as_lists() -> None:
    """Sizes, counts and weights computed with NumPy are accepted, and kept as Python values, so
    that the chain's fingerprint and states are those of the same plain ints."""
    ds = gl.Dataset(gl.from_sequence([np.arange(n) for n in (1, 2, 3, 5)]))
    batched = ds.batch(np.int64(2), pad=0)
    assert batched.fingerprint == ds.batch(2, pad=0).fingerprint
    assert [b.shape for b in batched] == [(2, 2), (2, 5)]
    buckets = ds.bucket_batch(len, np.array([2, 4]), np.int32(2), pad=0)
    assert buckets.fingerprint == ds.bucket_batch(len, [2, 4], 2, pad=0).fingerprint
    assert sorted(len(b) for b in buckets) == [1, 1, 2]
    packed = gl.Dataset(gl.from_sequence([{"tokens": np.arange(5)}])).pack(np.int64(4))
    assert [r["tokens"].tolist() for r in packed] == [[0, 1, 2, 3], [4, 0, 0, 0]]
    mixed = gl.Dataset.mix(
        [gl.Dataset(gl.from_sequence(["a"] * 4)), gl.Dataset(gl.from_sequence(["b"] * 4))], weights=np.array([1.0, 1.0])
    )
    assert sorted(mixed) == ["a"] * 4 + ["b"] * 4
    for bad in (np.bool_(True), np.float64(2.0)):
        with pytest.raises(ArgumentError, match=r"batch: n must be an int >= 1"):
            ds.batch(bad)
    numbers = gl.Dataset(gl.from_sequence(list(range(6))))
    as_numpy = numbers.seed(np.int64(5)).shuffle(seed=np.int32(3)).shard(np.int64(1), np.int64(2))
    assert as_numpy.fingerprint == numbers.seed(5).shuffle(seed=3).shard(1, 2).fingerprint
    assert list(as_numpy) == list(numbers.seed(5).shuffle(seed=3).shard(1, 2))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: gl.Dataset(gl.from_sequence(list(range(6)))).shard(True, 2), r"shard: rank must be an int"),
        (lambda: gl.Dataset(gl.from_sequence(list(range(6)))).shard(0, np.bool_(True)), r"shard: world_size must"),
        (lambda: gl.Dataset.stream(range(6)).shuffle(buffer_size=True, seed=1), r"shuffle: buffer_size must be"),
        (lambda: gl.Dataset(gl.from_sequence(list(range(6)))).shuffle(seed=True), r"shuffle: seed must be an int"),
        (lambda: gl.Dataset(gl.from_sequence(list(range(6)))).shuffle(seed=5 + 2**64), r"seed must be below 2\*\*64"),
    ],
)
def test_a_bool_or_a_seed_beyond_64_bits_is_refused(make: Any, message: str) -> None:
    """shard(True, 2) was rank 1, buffer_size=True a buffer of 1 (no shuffle at all), and seed 5 + 2**64
    the order of seed 5."""
    with pytest.raises(ArgumentError, match=message):
        make()


@pytest.mark.parametrize("make", [lambda ds: ds.batch(2, drop_last="False"), lambda ds: ds.pack(4, drop_last=1)])
def test_flags_must_be_bools(make: Any) -> None:
    with pytest.raises(ArgumentError, match=r"drop_last must be True or False"):
        make(gl.Dataset(gl.from_sequence([{"tokens": np.arange(3)}])))

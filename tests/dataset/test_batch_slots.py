"""Samples written straight into their batch rows: the batch is the one a copy would make, it
is where the samples were written (no copy), and it shares memory with nothing a copy would not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader import vision
from globalloader.errors import ArgumentError

N, BATCH = 21, 8  # the last batch is partial


def pictures(n: int = N, hw: tuple[int, int] = (40, 50)) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    return [{"__key__": f"p{i}", "image": rng.integers(0, 256, (*hw, 3), dtype=np.uint8)} for i in range(n)]


def source(records: list[dict[str, Any]], name: str = "pictures") -> gl.Dataset:
    return gl.Dataset(gl.from_sequence(records, key=name))


def expected(chain: gl.Dataset) -> list[np.ndarray]:
    """The chain's batches as a copy makes them: its samples, one by one, stacked."""
    images = [r["image"] for r in chain]
    return [np.stack(images[k : k + BATCH]) for k in range(0, len(images), BATCH)]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("chw", [False, True])
@pytest.mark.parametrize("flip_p", [0.0, 0.5, 1.0])
def test_a_batch_is_where_its_samples_were_written_and_equals_their_stack(normalize, chw, flip_p):
    crop = vision.RandomCropFlipNormalize(size=(24, 32), flip_p=flip_p, chw=chw, normalize=normalize)
    chain = source(pictures()).shuffle(seed=1).map(crop)
    written: list[int] = []  # where each sample's image was written

    def note(record):
        written.append(record["image"].ctypes.data)
        return record

    batches = [b["image"] for b in chain.map(note).batch(BATCH)]
    assert [len(b) for b in batches] == [8, 8, 5]
    for got, want in zip(batches, expected(chain), strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and got.flags.c_contiguous and got.flags.writeable
    starts = [written[k] for k in range(0, N, BATCH)]
    assert [b.ctypes.data for b in batches] == starts  # no copy: each batch is its samples' rows
    for a in range(len(batches)):
        for b in range(a + 1, len(batches)):
            assert not np.shares_memory(batches[a], batches[b])


@pytest.mark.parametrize("normalize", [True, False])
def test_the_resized_crop_writes_in_place_too(normalize):
    crop = vision.RandomResizedCropFlipNormalize(size=16, normalize=normalize)
    chain = source(pictures()).map(crop)
    batches = [b["image"] for b in chain.batch(BATCH)]
    for got, want in zip(batches, expected(chain), strict=True):
        np.testing.assert_array_equal(got, want)
    assert all(b.base is not None and b.base.shape == b.shape for b in batches)  # a slot buffer, not a stack


def test_skipped_samples_leave_no_row_behind():
    crop = vision.RandomCropFlipNormalize(size=24)
    bad = {"p3", "p7", "p8", "p15"}  # p7 ends the first batch of 8, p15 the second

    def fail_some(record):
        if record["__key__"] in bad:
            raise ValueError(f"bad {record['__key__']}")
        return record

    chain = source(pictures()).map(crop).map(fail_some)
    with pytest.warns(UserWarning, match="skipped"), gl.Loader(chain.batch(BATCH), on_error="skip") as loader:
        batches = list(loader)
    kept = [r for r in source(pictures()).map(crop) if r["__key__"] not in bad]
    assert [list(b["__key__"]) for b in batches] == [
        [r["__key__"] for r in kept[:6]],
        [r["__key__"] for r in kept[6:12]],
        [r["__key__"] for r in kept[12:]],
    ]
    got = np.concatenate([b["image"] for b in batches])
    np.testing.assert_array_equal(got, np.stack([r["image"] for r in kept]))


def test_one_array_in_two_fields_makes_two_arrays_of_the_batch():
    crop = vision.RandomCropFlipNormalize(size=24)
    batch = next(iter(source(pictures()).map(crop).map(lambda r: {**r, "again": r["image"]}).batch(BATCH)))
    np.testing.assert_array_equal(batch["image"], batch["again"])
    assert batch["image"].base is not None and batch["image"].base.shape == batch["image"].shape  # in place
    assert not np.shares_memory(batch["image"], batch["again"])  # the other field is a copy


def test_two_outputs_per_sample_each_get_their_own_batch():
    first, second = vision.RandomCropFlipNormalize(size=24), vision.RandomCropFlipNormalize(size=16, chw=True)

    def two_views(record, rng):
        return {**record, "image": first(record, rng=rng)["image"], "small": second(record, rng=rng)["image"]}

    chain = source(pictures()).map(two_views)
    samples = list(chain)
    for k, batch in enumerate(chain.batch(BATCH)):
        part = samples[k * BATCH : (k + 1) * BATCH]
        np.testing.assert_array_equal(batch["image"], np.stack([s["image"] for s in part]))
        np.testing.assert_array_equal(batch["small"], np.stack([s["small"] for s in part]))
        assert not np.shares_memory(batch["image"], batch["small"])


def test_a_batch_changed_in_place_never_changes_a_cached_sample():
    chain = source(pictures()).map(lambda r: {**r, "image": vision.normalize(r["image"])}).cache().batch(BATCH)
    with gl.Loader(chain) as loader:
        first = []
        for batch in loader:
            first.append(batch["image"].copy())
            batch["image"][...] = -1.0  # the training step reuses the batch's memory
        second = [batch["image"] for batch in loader]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_maps_after_a_cache_still_write_in_place_and_the_cache_stays_whole():
    crop = vision.RandomCropFlipNormalize(size=16)
    written: list[int] = []

    def note(record):
        written.append(record["image"].ctypes.data)
        return record

    prepared = source(pictures()).map(lambda r: {**r, "image": r["image"][::2, ::2].copy()}, name="half")
    cached = prepared.cache().map(crop).map(note).batch(BATCH)
    with gl.Loader(cached) as loader, gl.Loader(prepared.map(crop).batch(BATCH)) as plain:
        for _ in range(2):  # the second epoch reads the cache
            written.clear()
            wanted = list(plain)  # the same epoch's batches, never cached
            for k, (got, want) in enumerate(zip(loader, wanted, strict=True)):
                np.testing.assert_array_equal(got["image"], want["image"])
                assert got["image"].ctypes.data == written[k * BATCH]  # no copy after the cache
                got["image"][...] = -1.0  # the training step reuses the batch's memory


def test_records_that_are_rows_of_one_array_are_copied_into_the_batch():
    rows = np.random.default_rng(3).integers(0, 256, (N, 8, 8, 3), dtype=np.uint8)
    chain = gl.Dataset(gl.from_sequence(list(rows), key="rows")).batch(BATCH)
    batches = list(chain)
    np.testing.assert_array_equal(np.concatenate(batches), rows)
    assert not any(np.shares_memory(b, rows) for b in batches)


def test_samples_of_different_shapes_are_still_a_named_error():
    records = [*pictures(4), {"__key__": "wide", "image": np.zeros((40, 60, 3), np.uint8)}]
    chain = source(records, "mixed").map(lambda r: {**r, "image": vision.normalize(r["image"])}).batch(BATCH)
    with pytest.raises(ArgumentError, match="different shapes"):
        list(chain)


def test_thread_workers_build_their_batches_in_place_too():
    crop = vision.RandomCropFlipNormalize(size=24)
    chain = source(pictures()).shuffle(seed=2).map(crop)
    with gl.Loader(chain.batch(BATCH), workers=2, mode="thread") as loader:
        got = [b["image"] for b in loader]
    for a, b in zip(got, expected(chain), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.base is not None and a.base.shape == a.shape  # a slot buffer, not a stack

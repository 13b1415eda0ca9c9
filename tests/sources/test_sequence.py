"""from_sequence: in-memory sequences as sources."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, FingerprintError, SampleIndexError
from globalloader.sources import Source, from_sequence
from helpers import same


def test_items_are_the_records_as_they_are() -> None:
    record = {"__key__": "a", "x": 1}
    src = from_sequence([record, 5, "text"])
    assert isinstance(src, Source) and len(src) == 3
    assert src[0] is record and src[1] == 5 and src[2] == "text"


def test_numpy_array_and_range() -> None:
    assert from_sequence(np.arange(4) * 2)[3] == 6
    assert len(from_sequence(range(10))) == 10 and from_sequence(range(10))[9] == 9


@pytest.mark.parametrize(
    "items",
    [
        list(range(7)),
        [(f"f{i}.jpg", i % 2) for i in range(7)],
        [{"__key__": str(i), "v": i} for i in range(7)],
        np.arange(7) * 3,
    ],
)
def test_a_dataset_over_from_sequence_yields_what_one_over_the_bare_sequence_yields(items) -> None:
    bare = list(gl.Dataset(items).shuffle(seed=3))
    wrapped = list(gl.Dataset(from_sequence(items)).shuffle(seed=3))
    assert wrapped == bare and sorted(map(repr, bare)) == sorted(map(repr, list(items)))
    assert same(list(gl.Dataset(from_sequence(items)).batch(3)), list(gl.Dataset(items).batch(3)))


def test_fingerprint_hashes_content() -> None:
    assert from_sequence([1, 2, 3]).fingerprint == from_sequence([1, 2, 3]).fingerprint
    assert from_sequence([1, 2, 3]).fingerprint != from_sequence([1, 2, 4]).fingerprint
    assert from_sequence([1, 2, 3]).fingerprint.startswith("sequence:")


def test_unpicklable_items_need_a_key_instead_of_a_guess() -> None:
    items = [threading.Lock()]
    src = from_sequence(items)
    assert src[0] is items[0]  # reading needs no fingerprint
    with pytest.raises(FingerprintError, match=r"cannot be pickled.*key="):
        _ = src.fingerprint
    keyed = from_sequence(items, key="locks-v1")
    assert keyed.fingerprint == from_sequence([threading.Lock()], key="locks-v1").fingerprint
    assert keyed.fingerprint != from_sequence(items, key="locks-v2").fingerprint


def test_pickles() -> None:
    src = from_sequence([{"__key__": "k", "v": np.ones(3)}])
    clone = pickle.loads(pickle.dumps(src))
    assert clone.fingerprint == src.fingerprint and clone[0]["__key__"] == "k"


@pytest.mark.parametrize("bad", [5, "abc", b"abc", {"a": 1}, None])
def test_rejects_non_sequences(bad: object) -> None:
    with pytest.raises(ArgumentError, match="seq must be a sequence"):
        from_sequence(bad)  # type: ignore[arg-type]


def test_index_errors() -> None:
    src = from_sequence([1, 2])
    with pytest.raises(SampleIndexError, match=r"index 2 is out of range .* length 2"):
        src[2]
    with pytest.raises(SampleIndexError, match="index -1 is negative"):
        src[-1]
    with pytest.raises(ArgumentError, match="got float"):
        src[0.0]  # type: ignore[index]

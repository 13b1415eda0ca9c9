"""The Source protocol, the shared index check, fingerprints and the package surface."""

from __future__ import annotations

import numpy as np
import pytest

import globalloader.sources as sources
from globalloader.errors import ArgumentError, GlobalLoaderError, SampleIndexError
from globalloader.sources.base import Source, check_index, fingerprint_of


def test_check_index_accepts_integers_in_range() -> None:
    assert check_index(np.int32(2), 3, "src") == 2
    assert type(check_index(np.int64(0), 3, "src")) is int


@pytest.mark.parametrize(
    ("index", "error", "message"),
    [
        (3, SampleIndexError, "index 3 is out of range for 'src' of length 3"),
        (-1, SampleIndexError, "index -1 is negative; 'src' has length 3"),
        (1.5, ArgumentError, "index must be an int, got float"),
        (False, ArgumentError, "got bool"),
    ],
)
def test_check_index_errors(index: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        check_index(index, 3, "src")
    assert isinstance(info.value, GlobalLoaderError)


def test_sample_index_error_is_an_index_error() -> None:
    with pytest.raises(IndexError):
        check_index(10, 3, "src")


def test_fingerprint_of_is_stable_and_sensitive() -> None:
    assert fingerprint_of("K", ["a", "b"]) == fingerprint_of("K", iter(["a", "b"]))
    assert fingerprint_of("K", ["a", "b"]) != fingerprint_of("K", ["ab"])
    assert fingerprint_of("K", ["a"]).startswith("K:")


def test_protocol_is_structural() -> None:
    class Minimal:
        fingerprint = "x"

        def __len__(self) -> int:
            return 0

        def __getitem__(self, index: int) -> dict:
            return {}

    assert isinstance(Minimal(), Source)
    assert not isinstance([1, 2], Source)


def test_public_names_sorted_and_importable() -> None:
    assert sources.__all__ == sorted(sources.__all__)
    assert all(hasattr(sources, name) for name in sources.__all__)

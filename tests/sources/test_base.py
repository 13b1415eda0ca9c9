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


def test_built_in_sources_offer_the_abilities_the_plan_uses(make_shards, write_parts, tmp_path) -> None:
    import pyarrow as pa

    from globalloader.sources import base

    parquet = sources.Parquet(write_parts(pa.table({"id": np.arange(80)})))
    shards = sources.TarShards(make_shards())
    offered = {
        parquet: {
            "BatchReads",
            "ColumnarReads",
            "GathersAhead",
            "Blocks",
            "ArrowBlocks",
            "KeepsBlocks",
            "CachesDecodedBlocks",
        },
        parquet.local_copy(str(tmp_path / "copy")): {"ColumnarReads", "Blocks"},
        shards: {"Blocks", "KeepsBlocks", "Prefetching"},
        sources.from_sequence([1, 2]): set(),
    }
    abilities = [
        base.BatchReads,
        base.ColumnarReads,
        base.GathersAhead,
        base.Blocks,
        base.ArrowBlocks,
        base.KeepsBlocks,
        base.CachesDecodedBlocks,
        base.Prefetching,
    ]
    for source, expected in offered.items():
        assert {p.__name__ for p in abilities if base.capable(source, p)} == expected, source
        assert base.capable(source, base.RecordStream) == hasattr(type(source), "iter_records")


class _HalfColumnar:
    """Says it is columnar but never wrote read_columns: a bug the plan must name."""

    fingerprint = "half"
    columnar = True

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, int]:
        return {"__key__": str(index), "x": index}


def test_a_half_written_ability_is_named_when_the_chain_is_planned() -> None:
    import globalloader as gl

    with pytest.raises(ArgumentError, match=r"_HalfColumnar has columnar but not read_columns"):
        gl.Dataset(_HalfColumnar()).batch(2)
    with pytest.raises(ArgumentError, match=r"_NoLen has no __len__"):
        gl.Dataset(type("_NoLen", (), {"__getitem__": lambda self, i: i})())

"""DecodeFields: tar shard fields decoded by extension, checked against webdataset's own decode."""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import webdataset
from PIL import Image

import globalloader as gl
from globalloader.errors import ArgumentError, CorruptSampleError
from globalloader.sources import DecodeFields
from helpers import same


def _png(i: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((6, 8, 3), i * 10, np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def shards(tmp_path: pathlib.Path) -> list[str]:
    with gl.TarWriter(str(tmp_path / "fields-%06d.tar"), maxcount=4) as writer:
        for i in range(10):
            writer.write(
                {
                    "__key__": f"s{i:03d}",
                    "png": _png(i),
                    "seg.png": _png(i + 1),
                    "cls": i % 3,
                    "index": i,
                    "json": {"caption": f"a {i}", "tags": [i]},
                    "txt": f"text {i} é",
                    "npy": np.arange(i, i + 3.0),
                    "bin": bytes([i, 255]),
                    "pyd": b"\x80\x04K\x01.",
                }
            )
    return writer.paths


def test_fields_decode_by_extension(shards: list[str]) -> None:
    record = DecodeFields()(gl.TarShards(shards)[7])
    assert record["__key__"] == "s007" and record["__url__"] == shards[1]
    assert record["png"].dtype == np.uint8 and record["png"].shape == (6, 8, 3) and (record["png"] == 70).all()
    assert (record["seg.png"] == 80).all()  # the last extension decides
    assert record["cls"] == 1 and record["index"] == 7 and type(record["index"]) is int
    assert record["json"] == {"caption": "a 7", "tags": [7]} and record["txt"] == "text 7 é"
    assert np.array_equal(record["npy"], [7.0, 8.0, 9.0])
    assert record["bin"] == bytes([7, 255]) and record["pyd"] == b"\x80\x04K\x01."  # unknown and pickles: bytes


def test_the_same_values_as_webdataset_decode(shards: list[str]) -> None:
    theirs = list(webdataset.WebDataset(shards, shardshuffle=False).decode("rgb8"))
    ours = [DecodeFields()(r) for r in gl.TarShards(shards)]
    assert len(ours) == len(theirs) == 10
    for mine, reference in zip(ours, theirs, strict=True):
        for field in ("png", "seg.png", "cls", "index", "json", "txt", "npy"):
            assert same(mine[field], reference[field]), (mine["__key__"], field, mine[field], reference[field])


def test_image_output_choices(shards: list[str]) -> None:
    record = gl.TarShards(shards)[2]
    pil = DecodeFields(image="pil")(record)["png"]
    assert isinstance(pil, Image.Image) and pil.size == (8, 6)
    assert DecodeFields(image=None)(record)["png"] == record["png"]
    assert DecodeFields(mode="L")(record)["png"].shape == (6, 8, 1)
    assert record["png"] == _png(2), "the input record was changed"
    with pytest.raises(ArgumentError, match="image must be one of"):
        DecodeFields(image="tensor")


def test_deterministic_shared_and_cached_in_a_chain(shards: list[str], tmp_path: pathlib.Path) -> None:
    chain = gl.Dataset(gl.TarShards(shards)).map(DecodeFields(), shared=True).cache(tmp_path / "c").batch(5)
    first, again = list(chain), list(chain)
    assert same(first, again)
    assert first[0]["png"].shape == (5, 6, 8, 3) and first[1]["cls"].tolist() == [2, 0, 1, 2, 0]
    assert (
        chain.fingerprint
        == gl.Dataset(gl.TarShards(shards)).map(DecodeFields(), shared=True).cache(tmp_path / "c").batch(5).fingerprint
    )


@pytest.mark.parametrize(
    ("field", "data", "kind"),
    [
        ("json", b"{not json", "JSON"),
        ("txt", b"\xff\xfe\xfa", "utf-8 text"),
        ("cls", b"cat", "an int"),
        ("npy", b"\x93NUMPY garbage", "a .npy array"),
        ("jpg", b"\xff\xd8\xff\xe0broken", "image"),
    ],
)
def test_a_field_that_does_not_decode_names_the_key_and_the_field(field: str, data: bytes, kind: str) -> None:
    record = {"__key__": "bad7", "__url__": "shard-000002.tar", field: data}
    names_all = rf"(?=.*'bad7' in shard-000002\.tar)(?=.*field '{field}')(?=.*{kind})"
    with pytest.raises(CorruptSampleError, match=names_all):
        DecodeFields()(record)


def test_an_object_npy_is_refused_not_unpickled() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CorruptSampleError, match=r"'obj'.*field 'npy'.*allow_pickle"):
        DecodeFields()({"__key__": "obj", "npy": buffer.getvalue()})


def test_without_pillow_text_fields_decode_and_image_fields_name_the_extra(shards: list[str]) -> None:
    script = f"""
import sys
sys.modules["PIL"] = None  # as if Pillow were not installed
import globalloader as gl
from globalloader.errors import MissingExtraError
record = gl.TarShards({shards!r})[1]
text_only = {{k: v for k, v in record.items() if not k.endswith("png")}}
assert gl.DecodeFields()(text_only)["txt"] == "text 1 é"
assert gl.DecodeFields(image=None)(record)["cls"] == 1
try:
    gl.DecodeFields()(record)
except MissingExtraError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "globalloader[vision]" in out.stdout

"""ImageFolder on real class folders of real image files."""

from __future__ import annotations

import io
import multiprocessing
import os
import pathlib
import pickle

import pytest
from PIL import Image

from globalloader.errors import ArgumentError, SampleIndexError, SourceError
from globalloader.sources import ImageFolder, Source


def _image(path: pathlib.Path, shade: int, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (shade, 0, 0)).save(out, format=fmt)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(out.getvalue())
    return out.getvalue()


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "train"
    _image(root / "dog" / "b.jpg", 1)
    _image(root / "dog" / "a.JPEG", 2)
    _image(root / "cat" / "z.png", 3, "PNG")
    _image(root / "cat" / "sub" / "y.jpg", 4)
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "cat" / ".hidden.jpg").write_bytes(b"skipped")
    (root / ".cache").mkdir()
    (root / "empty").mkdir()
    return root


def test_layout_labels_and_keys(root: pathlib.Path) -> None:
    src = ImageFolder(root)
    assert isinstance(src, Source)
    assert src.classes == ["cat", "dog", "empty"]
    assert len(src) == 4
    records = [src[i] for i in range(len(src))]
    assert [r["__key__"] for r in records] == ["cat/sub/y", "cat/z", "dog/a", "dog/b"]
    assert [r["label"] for r in records] == [0, 0, 1, 1]
    assert src.labels.tolist() == [0, 0, 1, 1]
    assert records[3]["image"] == (root / "dog" / "b.jpg").read_bytes()
    assert Image.open(io.BytesIO(records[1]["image"])).size == (8, 6)


def test_extensions_argument(root: pathlib.Path) -> None:
    src = ImageFolder(root, extensions=("png",))
    assert [src[i]["__key__"] for i in range(len(src))] == ["cat/z"]
    with pytest.raises(ArgumentError, match="extensions"):
        ImageFolder(root, extensions=".jpg")  # type: ignore[arg-type]


def test_fingerprint_changes_with_content(root: pathlib.Path) -> None:
    first = ImageFolder(root).fingerprint
    assert ImageFolder(root).fingerprint == first
    target = root / "dog" / "b.jpg"
    target.write_bytes(target.read_bytes() + b"\0")
    os.utime(target, ns=(1, 1))
    assert ImageFolder(root).fingerprint != first


def test_missing_or_empty_root_names_folder(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SourceError, match=f"image folder not found: {tmp_path / 'nope'}"):
        ImageFolder(tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    _image(tmp_path / "flat" / "x.jpg", 1)  # an image directly under root is not in a class
    with pytest.raises(SourceError, match=f"no images .* under {tmp_path / 'flat'}"):
        ImageFolder(tmp_path / "flat")
    with pytest.raises(ArgumentError, match="root"):
        ImageFolder(3)  # type: ignore[arg-type]


def test_deleted_file_names_it(root: pathlib.Path) -> None:
    src = ImageFolder(root)
    (root / "dog" / "a.JPEG").unlink()
    with pytest.raises(SourceError, match=f"cannot read image {root / 'dog' / 'a.JPEG'}"):
        src[2]
    assert src[3]["__key__"] == "dog/b"


def test_index_errors(root: pathlib.Path) -> None:
    src = ImageFolder(root)
    with pytest.raises(SampleIndexError, match=r"index 4 is out of range .* length 4"):
        src[4]
    with pytest.raises(SampleIndexError, match="negative"):
        src[-1]
    with pytest.raises(ArgumentError):
        src["dog/a"]  # type: ignore[index]


def test_pickle_and_fork(root: pathlib.Path) -> None:
    src = ImageFolder(root)
    clone = pickle.loads(pickle.dumps(src))
    assert clone[1] == src[1] and clone.classes == src.classes
    reader, writer = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.get_context("fork").Process(target=lambda: writer.send([src[i] for i in range(len(src))]))
    proc.start()
    assert reader.recv() == [src[i] for i in range(len(src))]
    proc.join(30)
    assert proc.exitcode == 0

"""open_source: the kind of dataset a location holds, local or in S3 (moto), and the source that
reads it as it is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options
from globalloader.errors import SourceError
from globalloader.sources.detect import open_source


def write_tars(pattern: str, n: int = 6, storage_options: dict[str, Any] | None = None) -> None:
    with gl.TarWriter(pattern, maxcount=4, storage_options=storage_options) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i}", "txt": f"sample {i}"})


def test_local_folders_files_and_patterns(tmp_path):
    write_tars(str(tmp_path / "tars" / "part-%02d.tar"))
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "table.parquet")
    (tmp_path / "images" / "cat").mkdir(parents=True)
    (tmp_path / "images" / "cat" / "a.jpg").write_bytes(b"jpeg")
    cases = {
        str(tmp_path / "tars"): ("tar shards", 6),
        str(tmp_path / "tars/"): ("tar shards", 6),
        str(tmp_path / "tars" / "part-{00..01}.tar"): ("tar shards", 6),
        str(tmp_path / "tars" / "part-01.tar"): ("tar shards", 2),
        str(tmp_path / "table.parquet"): ("Parquet files", 3),
        str(tmp_path / "images"): ("image folder", 1),
    }
    for location, (kind, length) in cases.items():
        found, source = open_source(location)
        assert (found, len(source)) == (kind, length), location
    with pytest.raises(SourceError, match=f"{tmp_path / 'nothing'}: no dataset globalloader can read is there"):
        open_source(tmp_path / "nothing")


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    server = MotoServer()
    proxy = FaultProxy(server.port)
    yield {"bucket": new_bucket(proxy.url), "options": options(proxy.url)}
    proxy.stop()
    server.stop()


def test_a_folder_url(s3):
    bucket, opts = s3["bucket"], s3["options"]
    write_tars(f"s3://{bucket}/train/part-%02d.tar", storage_options=opts)
    kind, source = open_source(f"s3://{bucket}/train/", opts)
    assert kind == "tar shards"
    assert [r["txt"] for r in gl.Dataset(source).iterator()] == [f"sample {i}".encode() for i in range(6)]


def test_other_tools_folders_are_read_as_they_are(tmp_path):
    from tests.sources.test_hf import save_like_datasets
    from tests.sources.test_litdata import write_plain
    from tests.sources.test_mds import write_mds

    write_mds(tmp_path / "mds", n=10)
    write_plain(tmp_path / "lit", [(i, f"item {i}") for i in range(7)])
    table = pa.table({"id": pa.array(range(5), pa.int64())})
    save_like_datasets(tmp_path / "hf", table, {"id": {"dtype": "int64", "_type": "Value"}}, shards=1, rows=2)
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    cases = {
        "mds": ("Mosaic MDS", gl.MDS, 10),
        "lit": ("LitData chunks", gl.LitData, 7),
        "hf": ("Hugging Face dataset", gl.HFDataset, 5),
    }
    for folder, (kind, reader, length) in cases.items():
        found, source = open_source(tmp_path / folder)
        assert (found, type(source), len(source)) == (kind, reader, length), folder
        assert gl.Dataset(source).iterator().__next__() == reader(str(tmp_path / folder))[0]
    with pytest.raises(gl.errors.ArgumentError, match="train"):  # a DatasetDict: its splits named
        open_source(tmp_path / "dict")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "index.json").write_text('{"shards": [{"format": "not mds"}]}')
    with pytest.raises(SourceError, match="no dataset globalloader can read is there"):
        open_source(tmp_path / "other" / "index.json")

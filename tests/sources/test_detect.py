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

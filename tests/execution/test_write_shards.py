"""write_shards: a chain written as tar or Parquet shards by a Loader's workers; the same bytes
for any worker count, resumable after a kill at any point, local and in S3 (moto)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options
from globalloader.errors import ArgumentError, TransformError
from globalloader.execution.writer import manifest_url
from helpers import same

JOB = Path(__file__).with_name("write_job.py")


SAMPLES = 100  # four tasks of the Loader's 32 samples: a failure in the third comes after shards are done
FAIL_AT = 70


def records(n: int = SAMPLES) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"__key__": f"k{i:03d}", "data": rng.bytes(int(rng.integers(1, 2000))), "n": i} for i in range(n)]


FAIL_FLAG: list[Path] = []  # while the path it holds exists, `flaky` fails on sample FAIL_AT


def flaky(record: dict) -> dict:
    if FAIL_FLAG and FAIL_FLAG[0].exists() and record["n"] == FAIL_AT:
        raise ValueError(f"sample {FAIL_AT} cannot be re-encoded")
    return {**record, "data": record["data"][::-1]}


def chain(n: int = SAMPLES) -> gl.Dataset:
    return gl.Dataset(gl.from_sequence(records(n))).map(flaky)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def written(folder: Path, fmt: str = "tar") -> list[dict]:
    paths = sorted(str(p) for p in folder.glob(f"*.{fmt}"))
    source = gl.TarShards(paths) if fmt == "tar" else gl.Parquet(paths)
    return [{k: v for k, v in r.items() if not k.startswith("__")} for r in gl.Dataset(source).iterator()]


def expected(n: int = SAMPLES, fmt: str = "tar") -> list[dict]:
    # tar fields come back as bytes, Parquet columns as typed values
    return [{"data": r["data"][::-1], "n": str(r["n"]).encode() if fmt == "tar" else r["n"]} for r in records(n)]


# Shard ends decided by the samples' sizes (written by the main process), or known in advance
# (each shard written whole by a worker).
LIMITS = [{"maxsize": 20_000}, {"maxcount": 7}]


@pytest.mark.parametrize("limit", LIMITS, ids=["maxsize", "maxcount"])
@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_round_trip_in_order_and_same_bytes_for_any_worker_count(tmp_path, fmt, limit):
    outputs = {}
    for workers in (0, 1, 2):
        folder = tmp_path / f"w{workers}"
        paths = gl.write_shards(chain(), folder / f"part-%04d.{fmt}", workers, **limit, format=fmt, progress=False)
        assert paths == [str(folder / f"part-{i:04d}.{fmt}") for i in range(len(paths))]
        assert len(paths) > 3
        outputs[workers] = {k: v for k, v in files(folder).items() if not k.endswith(".json")}
        assert same(written(folder, fmt), expected(fmt=fmt))
    assert outputs[0] == outputs[1] == outputs[2]
    if fmt == "tar":
        assert sum(name.endswith(".idx") for name in outputs[0]) == len(paths)


@pytest.mark.parametrize("limit", [{}, {"maxcount": 1}], ids=["maxsize", "maxcount"])
def test_tar_keys_are_made_tar_safe_or_numbered(tmp_path, limit):
    samples = [{"__key__": "/a/b.c/x.y.jpg", "v": b"1"}, {"v": b"2"}]
    paths = gl.write_shards(gl.Dataset(samples), tmp_path / "s-%02d.tar", 1, **limit, progress=False)
    keys = [r["__key__"] for r in gl.Dataset(gl.TarShards(paths)).iterator()]
    assert keys == ["a/b.c/x_y_jpg", "000000001"]


def test_a_shard_written_whole_by_a_worker_has_the_bytes_tar_writer_writes(tmp_path):
    paths = gl.write_shards(chain(), tmp_path / "w" / "out-%03d.tar", 2, maxcount=8, progress=False)
    with gl.TarWriter(str(tmp_path / "t" / "out-%03d.tar"), maxcount=8) as writer:
        for record in chain().iterator():
            writer.write(record)
    assert [Path(p).name for p in paths] == [Path(p).name for p in writer.paths]
    assert files(tmp_path / "w").keys() - {"out-manifest.tar.json"} == files(tmp_path / "t").keys()
    assert all(files(tmp_path / "w")[n] == data for n, data in files(tmp_path / "t").items())


def test_a_bad_sample_in_a_shard_a_worker_writes_is_an_error_even_with_skip(tmp_path):
    samples = [{"__key__": f"k{i}", "v": b"x"} for i in range(6)] + [{"__key__": "k6", "v": object()}]
    with pytest.raises(ArgumentError, match=r"'k6'.*unsupported type"):
        gl.write_shards(gl.Dataset(samples), tmp_path / "s-%02d.tar", 2, maxcount=3, on_error="skip", progress=False)
    assert sorted(os.listdir(tmp_path)) == [
        "s-00.tar",
        "s-00.tar.idx",
        "s-01.tar",
        "s-01.tar.idx",
        "s-manifest.tar.json",
    ]


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ArgumentError, match="number field"):
        gl.write_shards(chain(), tmp_path / "out.tar", progress=False)
    with pytest.raises(ArgumentError, match="format must be one of"):
        gl.write_shards(chain(), tmp_path / "out-%03d.zip", format="zip", progress=False)
    with pytest.raises(ArgumentError, match=r"before \.batch\(\)"):
        gl.write_shards(chain().batch(4), tmp_path / "out-%03d.tar", progress=False)
    with pytest.raises(ArgumentError, match="maxcount"):
        gl.write_shards(chain(), tmp_path / "out-%03d.tar", maxcount=0, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_mismatched_restart_names_the_manifest(tmp_path):
    pattern = tmp_path / "out-%03d.tar"
    gl.write_shards(chain(), pattern, maxcount=5, progress=False)
    manifest = manifest_url(str(pattern))
    assert manifest == str(tmp_path / "out-manifest.tar.json")
    before = files(tmp_path)
    with pytest.raises(ArgumentError, match=f"{manifest}.*maxcount 5 there, 6 here"):
        gl.write_shards(chain(), pattern, maxcount=6, progress=False)
    with pytest.raises(ArgumentError, match=f"{manifest}.*chain"):
        gl.write_shards(chain(SAMPLES + 1), pattern, maxcount=5, progress=False)
    with pytest.raises(ArgumentError, match=f"{manifest}.*shard_format 'tar' there, 'parquet' here"):
        gl.write_shards(chain(), pattern, maxcount=5, format="parquet", progress=False)
    assert files(tmp_path) == before
    (tmp_path / "out-002.tar").unlink()
    with pytest.raises(ArgumentError, match=f"out-002.tar is missing, though {manifest} lists it"):
        gl.write_shards(chain(), pattern, maxcount=5, progress=False)
    Path(manifest).write_text("{not json")
    with pytest.raises(ArgumentError, match=f"{manifest} is not a manifest of write_shards"):
        gl.write_shards(chain(), pattern, maxcount=5, progress=False)


def identities(folder: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    return {n: ((folder / n).stat().st_ino, (folder / n).stat().st_mtime_ns) for n in names}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_map_stops_with_nothing_half_written_and_the_same_call_resumes(tmp_path, workers):
    # maxcount: each shard is written whole by a worker
    reference = tmp_path / "reference"
    gl.write_shards(chain(), reference / "out-%03d.tar", maxcount=5, progress=False)
    folder = tmp_path / "run"
    FAIL_FLAG[:] = [tmp_path / "fail"]
    FAIL_FLAG[0].touch()
    try:
        with pytest.raises(TransformError, match=f"k{FAIL_AT:03d}|index {FAIL_AT}"):
            gl.write_shards(chain(), folder / "out-%03d.tar", workers, maxcount=5, progress=False)
        # the shards before the one of sample 70 (14 at most) are finished and recorded; the
        # failed one never appears, nor any temporary file
        record = json.loads((folder / "out-manifest.tar.json").read_text())
        count = len(record["shards"])
        assert count <= FAIL_AT // 5 and not record["complete"]
        assert [s["samples"] for s in record["shards"]] == [5] * count
        finished = [f"out-{i:03d}.tar{idx}" for i in range(count) for idx in ("", ".idx")]
        assert sorted(os.listdir(folder)) == sorted([*finished, "out-manifest.tar.json"])
        kept = identities(folder, finished)
        FAIL_FLAG[0].unlink()
        gl.write_shards(chain(), folder / "out-%03d.tar", workers, maxcount=5, progress=False)
    finally:
        FAIL_FLAG.clear()
    assert identities(folder, list(kept)) == kept  # the finished shard was not written again
    got, want = files(folder), files(reference)
    assert got.keys() == want.keys()
    assert all(got[n] == want[n] for n in want if not n.endswith(".json"))


def run_job(folder: Path, workers: int, kill_at: int | None = None, limit: str = "maxsize") -> int:
    env = {k: v for k, v in os.environ.items() if k != "KILL_AT"}
    if kill_at is not None:
        env["KILL_AT"] = str(kill_at)
    folder.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(JOB), "out/shard-%03d.tar", str(workers), limit],
        cwd=folder,
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
    )
    return proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["maxsize", "maxcount"])
def test_killed_at_any_point_the_same_call_ends_with_the_bytes_of_an_uninterrupted_run(tmp_path, limit):
    assert run_job(tmp_path / "reference", 2, limit=limit) == 0
    want = files(tmp_path / "reference" / "out")
    shards = sorted(n for n in want if n.endswith(".tar"))
    assert len(shards) >= 6
    # inline, the kill comes between two samples (after 128 were written); from a worker, while
    # the writer is wherever it is (behind by the tasks in flight), and in the last task
    for kill_at, workers in ((130, 0), (100, 2), (199, 2)):
        folder = tmp_path / f"kill{kill_at}"
        assert run_job(folder, workers, kill_at, limit) == -signal.SIGKILL
        out = folder / "out"
        left = files(out) if out.exists() else {}
        # whatever a killed run left under a shard's name is that shard, whole
        assert all(left[n] == want[n] for n in left if not n.startswith(".") and not n.endswith(".json"))
        manifest = out / "shard-manifest.tar.json"
        listed = [Path(s["path"]).name for s in json.loads(manifest.read_text())["shards"]] if manifest.exists() else []
        kept = identities(out, [n for s in listed for n in (s, s + ".idx")])
        assert run_job(folder, workers, limit=limit) == 0
        assert files(out) == want, f"killed at sample {kill_at}"
        assert identities(out, list(kept)) == kept, f"killed at sample {kill_at}: finished shards written again"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server) -> Iterator[dict[str, Any]]:
    proxy = FaultProxy(s3_server.port, seed=3)
    yield {"bucket": new_bucket(proxy.url), "options": options(proxy.url), "proxy": proxy}
    proxy.stop()


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_object_storage_through_transient_faults_and_a_resume(tmp_path, s3, fmt):
    bucket, opts, proxy = s3["bucket"], s3["options"], s3["proxy"]
    pattern = f"s3://{bucket}/conv/part-%03d.{fmt}"
    proxy.faults_on, proxy.slowdown = True, 0.3  # 503 SlowDown on the writer's reads (HEAD, GET), retried
    FAIL_FLAG[:] = [tmp_path / "fail"]
    FAIL_FLAG[0].touch()
    try:
        with pytest.raises(TransformError):
            gl.write_shards(chain(), pattern, 2, maxcount=25, storage_options=opts, format=fmt, progress=False)
        assert proxy.count("PUT", f"/{bucket}/conv/part-002") == 0  # the failed shard was never uploaded
        FAIL_FLAG[0].unlink()
        paths = gl.write_shards(chain(), pattern, 2, maxcount=25, storage_options=opts, format=fmt, progress=False)
    finally:
        FAIL_FLAG.clear()
    assert paths == [pattern % i for i in range(4)]
    assert proxy.faults["503"] > 0
    for shard in (f"part-000.{fmt}", f"part-001.{fmt}"):  # finished before the failure: uploaded once
        assert proxy.count("PUT", f"/{bucket}/conv/{shard}", shard) == 1
    proxy.faults_on = False
    source = (gl.TarShards if fmt == "tar" else gl.Parquet)(paths, storage_options=opts)
    got = [{k: v for k, v in r.items() if not k.startswith("__")} for r in gl.Dataset(source).iterator()]
    assert same(got, expected(fmt=fmt))


def test_on_error_skip_leaves_the_bad_sample_out_with_a_warning(tmp_path):
    FAIL_FLAG[:] = [tmp_path / "fail"]
    FAIL_FLAG[0].touch()
    try:
        outputs = []
        for workers in (0, 2):
            folder = tmp_path / f"w{workers}"
            with pytest.warns(UserWarning, match=f"skipped 1 bad sample.*index {FAIL_AT}"):
                gl.write_shards(chain(), folder / "out-%03d.tar", workers, maxcount=8, on_error="skip", progress=False)
            outputs.append({k: v for k, v in files(folder).items() if not k.endswith(".json")})
    finally:
        FAIL_FLAG.clear()
    assert outputs[0] == outputs[1]
    want = [r for r in expected() if r["n"] != str(FAIL_AT).encode()]
    assert same(written(tmp_path / "w0"), want)

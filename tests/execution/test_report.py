"""`Loader.report()`: the HTML input report and its diagnosis, on runs built to be input-bound
(a slow map) and compute-bound (a slow loop body), with real worker processes."""

from __future__ import annotations

import base64
import html
import io
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import globalloader as gl
from globalloader.errors import ArgumentError, StorageError
from globalloader.execution.report import INPUT_BOUND, diagnose
from globalloader.execution.timeline import MAX_BUCKETS, StepTimeline
from helpers import small_filesystem

BATCHES = 24
BATCH = 4


def slow_decode(i):
    time.sleep(0.01)  # 40 ms of work per batch of 4
    return np.full(8, i, np.int64)


def fast_decode(i):
    return np.full(8, i, np.int64)


def run(decode, step_s: float, workers: int = 2, batches: int = BATCHES) -> gl.Loader:
    ds = gl.Dataset(gl.from_sequence(list(range(batches * BATCH)))).map(decode).batch(BATCH)
    loader = gl.Loader(ds, workers=workers)
    for _ in loader:
        time.sleep(step_s)
    return loader


def images(page: str) -> list[Image.Image]:
    found = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    return [Image.open(io.BytesIO(base64.b64decode(data))) for data in found]


def test_input_bound_run_is_diagnosed_with_its_costliest_stage_and_a_worker_count(tmp_path: Path):
    with run(slow_decode, step_s=0.001) as loader:
        record = loader.run_record()
        path = loader.report(tmp_path / "input-report.html")
    sentence = diagnose(record)
    match = re.fullmatch(
        r"input-bound: (\d+)% of step time waiting; slow_decode is (\d+)% of worker time; "
        r"more workers would help up to ~(\d+)( \(this machine has \d+ cores\))?",
        sentence,
    )
    assert match, sentence
    waiting, decode_share, needed = (int(g) for g in match.groups()[:3])
    assert waiting >= 50 and decode_share >= 80, sentence
    assert needed > 2, sentence  # 40 ms of work per batch against ~1 ms of training: far more than 2 workers
    page = path.read_text()
    assert html.escape(sentence) in page
    assert record.timeline.count == BATCHES and sum(record.timeline.histogram) == BATCHES
    assert sum(record.timeline.steps) == BATCHES


def test_compute_bound_run_is_diagnosed_as_such(tmp_path: Path):
    # 100 ms a step: the workers keep up even on a machine loaded with other work
    with run(fast_decode, step_s=0.1, batches=16) as loader:
        record = loader.run_record()
        loader.report(tmp_path / "r.html")
    sentence = diagnose(record)
    assert sentence.startswith("compute-bound: "), sentence
    waiting = int(re.match(r"compute-bound: (\d+)%", sentence).group(1))
    assert waiting < INPUT_BOUND * 100, sentence
    assert re.search(r"the loop's own work \((\d+\.\d) ms per batch\) sets the pace", sentence), sentence
    per_batch = float(re.search(r"\((\d+\.\d) ms per batch\)", sentence).group(1))
    assert 95 <= per_batch <= 400, sentence  # the 100 ms sleep, give or take a loaded machine
    assert html.escape(sentence) in (tmp_path / "r.html").read_text()


def test_the_report_is_one_self_contained_page_with_three_plots(tmp_path: Path):
    with run(slow_decode, step_s=0.001, workers=1) as loader:
        path = loader.report(tmp_path / "report.html")
    page = path.read_text()
    assert page.startswith("<!doctype html>")
    assert not re.search(r"""(src|href)=["']?(https?:|//|/)""", page), "the page must load nothing from elsewhere"
    plots = images(page)
    assert len(plots) == 3 and all(p.size[0] > 300 and p.size[1] > 150 for p in plots)
    for title in ("Throughput over time", "Time per stage", "Wait per step"):
        assert f"<h2>{title}</h2>" in page
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"], "no temporary file is left behind"


def test_bad_paths_are_named(tmp_path: Path):
    with run(fast_decode, step_s=0.0, workers=0) as loader:
        with pytest.raises(ArgumentError, match=r"report\.txt.*must end in \.html"):
            loader.report(tmp_path / "report.txt")
        with pytest.raises(ArgumentError, match="does not exist"):
            loader.report(tmp_path / "missing" / "report.html")


def test_too_few_steps_say_so(tmp_path: Path):
    never_run = gl.Loader(gl.Dataset(gl.from_sequence([1, 2, 3])).batch(2))
    assert "too few steps to tell" in never_run.report(tmp_path / "empty.html").read_text()
    timeline = StepTimeline()
    timeline.step(0.5)
    record = gl.Loader(gl.Dataset(gl.from_sequence([1]))).run_record()
    record.timeline = timeline
    assert diagnose(record).startswith("too few steps")


def test_the_timeline_stays_bounded_and_keeps_its_totals():
    timeline = StepTimeline()
    timeline.begin()
    for _ in range(5):
        timeline.step(0.001)
    timeline.steps = [1] * (MAX_BUCKETS - 1)
    timeline.waits = [0.5] * (MAX_BUCKETS - 1)
    timeline.loops = [0.25] * (MAX_BUCKETS - 1)
    timeline._coarsen()
    assert timeline.width == 2.0 and len(timeline.steps) == MAX_BUCKETS // 2
    assert sum(timeline.steps) == MAX_BUCKETS - 1
    assert sum(timeline.waits) == pytest.approx(0.5 * (MAX_BUCKETS - 1))
    assert sum(timeline.loops) == pytest.approx(0.25 * (MAX_BUCKETS - 1))


def test_waits_land_in_their_log_bins():
    timeline = StepTimeline()
    for wait in (0.0, 2e-6, 0.05, 0.05, 5000.0):
        timeline.step(wait)
    h = timeline.histogram
    assert h[0] == 1 and h[-1] == 1 and sum(h) == 5
    assert h[1 + 3] == 1  # 2 us: the 4th bin of the first decade (10**-5.7 < 2e-6 <= 10**-5.6)
    assert h[1 + 10 * 4 + 6] == 2  # 50 ms: 10**-1.4 < 0.05 <= 10**-1.3


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 1 MiB tmpfs (tests run as root, where a chmod 0555 folder does not stop writes)."""
    with small_filesystem(tmp_path / "disk", "1m") as folder:
        yield folder


@pytest.fixture
def finished():
    """A Loader that ran a few steps without workers: something to report on."""
    with run(fast_decode, step_s=0.0, workers=0) as loader:
        yield loader


def fill(folder: Path) -> None:
    """Write zeros into `folder` until its disk is full."""

    def forever(filler) -> None:
        while True:
            filler.write(b"\0" * 4096)

    with open(folder / "filler", "wb", buffering=0) as filler, pytest.raises(OSError, match="No space left"):
        forever(filler)


@pytest.mark.parametrize(
    ("path", "match"),
    [
        (lambda tmp: tmp / "folder.html", "is a folder"),
        (lambda tmp: tmp / ("r" * 300 + ".html"), "cannot name a file: File name too long"),
        (lambda tmp: f"{tmp}/r\0.html", "without NUL characters"),
        (lambda tmp: 5, "must be a str or os.PathLike .*got 5"),
    ],
    ids=["folder", "300-characters", "nul", "int"],
)
def test_a_path_that_cannot_be_a_report_is_an_argument_error(tmp_path: Path, finished: gl.Loader, path, match: str):
    (tmp_path / "folder.html").mkdir()
    with pytest.raises(ArgumentError, match=match):
        finished.report(path(tmp_path))
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["folder.html"], "nothing is written"


def test_a_read_only_folder_is_a_storage_error_naming_the_path(small_disk: Path, finished: gl.Loader):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(StorageError, match=rf"report: cannot write '{small_disk}/r\.html': Read-only file system"):
        finished.report(small_disk / "r.html")
    assert list(small_disk.iterdir()) == []


def test_a_full_disk_keeps_the_previous_report_whole(small_disk: Path, finished: gl.Loader):
    before = finished.report(small_disk / "r.html").read_bytes()
    fill(small_disk)
    with pytest.raises(StorageError, match=rf"report: cannot write '{small_disk}/r\.html': No space left"):
        finished.report(small_disk / "r.html")
    assert (small_disk / "r.html").read_bytes() == before, "a failed write leaves the old page whole"
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "r.html"], "no temporary file is left"


def test_stage_names_are_drawn_as_text_not_mathtext(tmp_path: Path):
    ds = gl.Dataset(gl.from_sequence(list(range(16)))).map(fast_decode, name="$\\frac{a}{$ cost $x$").batch(4)
    with gl.Loader(ds, workers=1) as loader:
        for _ in loader:
            pass
        assert "$\\frac{a}{$ cost $x$" in loader.run_record().stages
        page = loader.report(tmp_path / "r.html").read_text()
    assert len(images(page)) == 3

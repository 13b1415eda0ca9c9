"""`globalloader status` tells the truth: consumed progress, jobs that left, and output when piped."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import globalloader as gl
from globalloader.service.launcher import status

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


def sample(i):
    return {"x": np.full(16, i), "index": i}


def test_progress_counts_what_the_job_consumed_not_what_it_asked_for(server):
    ds = gl.Dataset(gl.from_sequence(list(range(200)))).shuffle(seed=0).map(sample, shared=True).batch(5)
    with gl.Loader(ds, workers=1, prefetch=4, share=True, server=str(server.socket), name="reader") as loader:
        it = iter(loader)
        for _ in range(2):
            next(it)
        time.sleep(2.5)  # two heartbeats carry the progress
        (job,) = status(server.socket)["jobs"]
        assert job["consumed"] == 10 and job["delivered"] > 10, job  # prefetched tickets are not progress
        assert job["state"] == "loading"
        rest = list(it)
        assert len(rest) == 38
        time.sleep(2.5)
        (job,) = status(server.socket)["jobs"]
        assert job["consumed"] == 200 and job["state"] == "done"
    report = status(server.socket)
    assert report["jobs"] == [] and [(j["name"], j["state"]) for j in report["finished"]] == [("reader", "left")]


def test_status_prints_snapshots_when_piped(server):
    proc = subprocess.Popen(
        [sys.executable, "-m", "globalloader", "status", "--socket", str(server.socket)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(12)]
    finally:
        proc.kill()
        proc.wait()
    text = "".join(lines)
    assert "globalloader server" in text and "decodes saved" in text, text


def test_job_names_are_shown_as_written_never_as_markup(server):
    """A name is the user's text: `[/bold]` closing nothing once crashed the table (MarkupError)."""
    names = ["x[/bold]y", "[red]alpha[/red]", "[link=http://example.com]z", "back\\[slash]"]
    ds = gl.Dataset(gl.from_sequence(list(range(20)))).map(sample, shared=True).batch(5)
    loaders = [gl.Loader(ds, share=True, server=str(server.socket), name=name) for name in names]
    try:
        for loader in loaders:
            next(iter(loader))
        shown = server.status_table()
    finally:
        for loader in loaders:
            loader.close()
    assert shown.returncode == 0, shown.stderr
    rows = [line.split("│") for line in shown.stdout.splitlines() if line.startswith("│")]
    assert sorted(row[1].strip() for row in rows) == sorted(names), shown.stdout

"""Two share=True jobs whose shared maps differ only in what the code reads get their own samples.

Run as a script this file is one such job: `python test_sharing_key.py SOCKET OUT VARIANT SIZE
SLEEP`. Its shared map reads the module-level global SIZE ("global") or is a partial over it
("partial"); the code is identical in both jobs, only the value differs, so a sharing key that
ignored globals or partial arguments would put both jobs in one group and serve one job's samples
to the other.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader.service.launcher import request

pytestmark = pytest.mark.timeout(120)

SAMPLES = 60
SIZE = 4  # set from the command line in a job process


def decode(record):
    """The shared prefix: a vector of SIZE copies of the index (SIZE read as a global)."""
    return {"x": np.full(SIZE, record, np.float32), "index": record}


def fill(size, record):
    return {"x": np.full(size, record, np.float32), "index": record}


def chain(variant: str) -> gl.Dataset:
    fn = decode if variant == "global" else functools.partial(fill, SIZE)
    return gl.Dataset(gl.from_sequence(list(range(SAMPLES)))).shuffle(seed=0).map(fn, shared=True).batch(5)


def job(socket: str, out: str, variant: str, sleep: float) -> None:
    with open(out, "w") as f, gl.Loader(chain(variant), workers=1, share=True, server=socket) as loader:
        for batch in loader:
            f.write(
                json.dumps(
                    {"shape": list(batch["x"].shape), "index": batch["index"].tolist(), "x": batch["x"][:, 0].tolist()}
                )
                + "\n"
            )
            f.flush()
            time.sleep(sleep)


def start(server, out: Path, variant: str, size: int, sleep: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, str(server.socket), str(out), variant, str(size), str(sleep)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_pair(server, tmp_path: Path, variant: str, size_a: int, size_b: int) -> tuple[list[dict], list[dict]]:
    """Job A starts first and is slow; job B joins while A's samples are in the pool."""
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = start(server, out_a, variant, size_a, 0.1)
    deadline = time.monotonic() + 30
    while not (out_a.exists() and out_a.read_text().count("\n") >= 2):
        assert a.poll() is None, a.communicate()[0]
        assert time.monotonic() < deadline, "job A made no progress"
        time.sleep(0.05)
    b = start(server, out_b, variant, size_b, 0.0)
    for proc in (a, b):
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, output
    rows = [[json.loads(line) for line in out.read_text().splitlines()] for out in (out_a, out_b)]
    return rows[0], rows[1]


def check_own_samples(rows: list[dict], size: int) -> None:
    seen = Counter(i for row in rows for i in row["index"])
    assert seen == Counter(range(SAMPLES))
    shapes = {tuple(row["shape"]) for row in rows}
    assert shapes == {(5, size)}, f"a job whose map makes size-{size} samples received shapes {shapes}"
    assert all(x == i for row in rows for x, i in zip(row["x"], row["index"], strict=True))


@pytest.mark.parametrize("variant", ["global", "partial"])
def test_jobs_whose_shared_maps_differ_only_in_a_value_get_their_own_samples(server, tmp_path, variant):
    rows_a, rows_b = run_pair(server, tmp_path, variant, 4, 8)
    check_own_samples(rows_a, 4)
    check_own_samples(rows_b, 8)


def test_jobs_with_the_same_value_still_share_decodes(server, tmp_path):
    rows_a, rows_b = run_pair(server, tmp_path, "global", 4, 4)
    check_own_samples(rows_a, 4)
    check_own_samples(rows_b, 4)
    status = request(server.socket, "status")[1]
    assert status["requests"] == 2 * SAMPLES
    assert status["decodes"] < status["requests"], "equal maps were not shared"


if __name__ == "__main__":
    SIZE = int(sys.argv[4])
    job(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[5]))

"""A conversion run as its own process, for the tests that kill it: `python write_job.py PATTERN
WORKERS LIMIT` (LIMIT: `maxsize`, shards ended by size in the main process, or `maxcount`, each
shard written whole by a worker). With $KILL_AT set, the map SIGKILLs the writing process when it reaches that
sample (from a worker when there are workers), so the kill lands wherever the writer then is."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import globalloader as gl

SAMPLES = 200  # seven tasks of the Loader's 32 samples
LIMITS = {"maxsize": 16_000, "maxcount": 4}  # maxsize: shards of 2 to 6 samples, ended by their sizes


def records() -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"__key__": f"s{i:03d}", "data": rng.bytes(int(rng.integers(1, 3000))), "n": i} for i in range(SAMPLES)]


def grow(record: dict) -> dict:
    """Doubles the payload (a stand-in for a re-encode); kills the writer at sample $KILL_AT."""
    kill_at = os.environ.get("KILL_AT")
    if kill_at is not None and record["n"] == int(kill_at):
        os.kill(int(os.environ["WRITER_PID"]), signal.SIGKILL)
    return {**record, "data": record["data"] * 2}


def chain() -> gl.Dataset:
    return gl.Dataset(gl.from_sequence(records())).map(grow)


if __name__ == "__main__":
    os.environ["WRITER_PID"] = str(os.getpid())
    pattern, workers, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    gl.write_shards(chain(), pattern, workers=workers, **{limit: LIMITS[limit]}, progress=False)

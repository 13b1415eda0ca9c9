"""`globalloader status`: a live table of the server's jobs, memory pool and savings."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from globalloader._extras import require
from globalloader.service.launcher import request


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def render(status: dict[str, Any]) -> Any:
    """A rich renderable of one status snapshot."""
    rich_table = require("rich.table", "service")
    rich_console = require("rich.console", "service")
    jobs = rich_table.Table(title=f"globalloader server (pid {status['pid']}, up {status['uptime_s']:.0f} s)")
    for column in ("job", "pid", "set size", "epoch", "progress", "samples/s", "followed"):
        jobs.add_column(column, justify="left" if column == "job" else "right")
    for job in status["jobs"]:
        progress = job["delivered"] / job["size"] if job["size"] else 0.0
        jobs.add_row(
            job["name"], str(job["pid"]), f"{job['size']:,}", str(job["epoch"]), f"{progress:.0%}",
            f"{job['samples_per_s']:,.0f}", f"{job['followed_share']:.0%}",
        )
    pool = status["pool"]
    requests, decodes = status["requests"], status["decodes"]
    summary = (
        f"pool {_mib(pool['used'])} / {_mib(pool['capacity'])}: {pool['samples']:,} samples "
        f"({pool['referenced']:,} in use, {pool['cached']:,} cached), hits {pool.get('hits', 0):,}, "
        f"evictions {pool.get('evictions', 0):,}\n"
        f"requests {requests:,}, decodes {decodes:,}: "
        f"{status['decodes_saved']:,} decodes saved versus independent loading"
        + (f" ({status['decodes_saved'] / requests:.0%})" if requests else "")
        + f"; {status['workers']} workers"
    )
    return rich_console.Group(jobs, summary)


def watch(path: Path, interval: float = 1.0, once: bool = False) -> None:
    """Print the table once, or refresh it in place until Ctrl-C."""
    console = require("rich.console", "service").Console()
    if once:
        console.print(render(request(path, "status")[1]))
        return
    live_mod = require("rich.live", "service")
    with live_mod.Live(render(request(path, "status")[1]), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            live.update(render(request(path, "status")[1]))

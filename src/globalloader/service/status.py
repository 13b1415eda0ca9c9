"""`globalloader status`: a table of the server's jobs, its arena's use and savings.

Progress is what each job has consumed (yielded to its training loop) this epoch, not what it
asked the server for ahead of time. Jobs that ended stay in the table, marked "left", until
they are among the server's 20 most recent. On a terminal the table refreshes in place; piped,
a new snapshot is printed every interval, so `status | tee log` records something.

Everything in the table is text, never rich markup: a job's name is whatever its user chose
(`Loader(name="x[/bold]y")`), and so is a cache folder's path.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from globalloader._extras import require
from globalloader.service.launcher import status as fetch

COLUMNS = ("job", "pid", "state", "set size", "epoch", "consumed", "samples/s", "followed")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def rows(status: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per job, running ones first, then those that left."""
    out: list[tuple[str, ...]] = []
    for job in [*status["jobs"], *status.get("finished", [])]:
        progress = job["consumed"] / job["size"] if job["size"] else 0.0
        out.append(
            (
                job["name"],
                str(job["pid"]),
                job["state"],
                f"{job['size']:,}",
                str(job["epoch"]),
                f"{job['consumed']:,} ({progress:.0%})",
                f"{job['samples_per_s']:,.0f}",
                f"{job['followed_share']:.0%}",
            )
        )
    return out


def summary(status: dict[str, Any]) -> str:
    store = status["pool"]
    requests, decodes = status["requests"], status["decodes"]
    saved = f" ({status['decodes_saved'] / requests:.0%})" if requests else ""
    text = (
        f"pool {_mib(store['used'])} / {_mib(store['capacity'])}: {store['samples']:,} samples "
        f"({store['referenced']:,} in use, {store['cached']:,} cached), hits {store.get('hits', 0):,}, "
        f"evictions {store.get('evictions', 0):,}\n"
        f"requests {requests:,}, decodes {decodes:,}: {status['decodes_saved']:,} decodes saved versus "
        f"independent loading{saved}; {status['workers']} workers, {status.get('worker_restarts', 0)} restarted"
    )
    return text + _object_cache(status.get("cache"))


def _object_cache(cache: Any) -> str:
    """The machine's object cache, when the status has it (its figures count every process)."""
    if not isinstance(cache, dict):
        return ""
    if "error" in cache:
        return f"\nobject cache: {cache['error']}"  # the error names the folder or file
    return (
        f"\nobject cache {_mib(cache['bytes'])} / {_mib(cache['limit'])} in {cache['entries']:,} entries: "
        f"{_mib(cache['downloaded_bytes'])} downloaded ({cache['misses']:,} downloads), {cache['hits']:,} hits"
    )


def render(status: dict[str, Any]) -> Any:
    """A rich renderable of one status snapshot."""
    rich_table = require("rich.table", "service")
    rich_console = require("rich.console", "service")
    text = require("rich.text", "service").Text
    table = rich_table.Table(title=f"globalloader server (pid {status['pid']}, up {status['uptime_s']:.0f} s)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("job", "state") else "right")
    for row in rows(status):
        table.add_row(*map(text, row))
    return rich_console.Group(table, text(summary(status)))


def watch(path: Path, interval: float = 1.0, once: bool = False) -> None:
    """Print the table once; refresh it in place on a terminal; print a snapshot per interval
    when piped. Ends on Ctrl-C, or with ServerGoneError when the server stops."""
    console = require("rich.console", "service").Console()
    if once:
        console.print(render(fetch(path)))
        return
    if not sys.stdout.isatty():
        while True:
            console.print(render(fetch(path)))
            sys.stdout.flush()
            time.sleep(interval)
    live_mod = require("rich.live", "service")
    with live_mod.Live(render(fetch(path)), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            live.update(render(fetch(path)))

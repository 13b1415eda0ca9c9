"""`loader.report("input-report.html")`: one self-contained HTML page on a training run's input.

It answers "is my training waiting for data, and why": throughput over time, where the workers'
time goes per stage next to the loop's own time and its wait, a histogram of the wait per step,
and one sentence of diagnosis. Plots are drawn with matplotlib and embedded as PNG data, so the
file opens anywhere, offline, and can be attached to a bug report. `Loader.report` and the torch
drop-in's `DataLoader.report` both end here.

The diagnosis leaves out the first step's wait (workers starting, caches cold): a one-off cost
that says nothing about whether the steady state keeps up.
"""

from __future__ import annotations

import base64
import errno
import html
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from globalloader._extras import require
from globalloader.errors import ArgumentError, StorageError
from globalloader.execution.stats import LoaderStats
from globalloader.execution.timeline import StepTimeline, wait_edges
from globalloader.storage import write_atomic

INPUT_BOUND = 0.10  # waiting for data more than this share of the loop's time: input-bound
_STAGE_NAMES = {"transport": "transfer (to the loop)", "read": "read (source)", "fetch": "fetch (the dataset)"}


@dataclass
class RunRecord:
    """What a report is made of, from whichever front door measured it.

    `stages` are worker seconds per stage (summed over workers); `worker_idle_s` the seconds
    workers waited for work (None where not measured); `step` what one item of the loop is."""

    timeline: StepTimeline
    stages: dict[str, float]
    workers: int
    worker_idle_s: float | None = None
    step: str = "batch"
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, stats: LoaderStats, workers: int, step: str, notes: list[str] | None = None) -> RunRecord:
        """The record of a run that `stats` measured (a Loader's, or the torch drop-in's)."""
        totals = stats.report()
        return cls(
            timeline=stats.timeline,
            stages={name: stage["busy_s"] for name, stage in totals["stages"].items()},
            workers=workers,
            worker_idle_s=totals["workers"]["wait_s"] if workers else None,
            step=step,
            notes=notes or [],
        )

    def steady_wait(self) -> tuple[float, float]:
        """(waited, worked) seconds of the loop after its first step."""
        t = self.timeline
        return max(0.0, t.wait_s - (t.first_wait or 0.0)), t.loop_s


def diagnose(record: RunRecord) -> str:
    """One sentence: input-bound or compute-bound, the costliest stage, and how many workers fit."""
    t = record.timeline
    if t.count < 2:
        return "too few steps to tell: run at least a few steps before asking for a report"
    waited, worked = record.steady_wait()
    share = waited / (waited + worked) if waited + worked > 0 else 0.0
    steps = t.count - 1
    work = sum(record.stages.values())
    top = max(record.stages, key=lambda k: record.stages[k]) if work > 0 else None
    top_text = f"{_STAGE_NAMES.get(top, top)} is {record.stages[top] / work:.0%} of worker time" if top else ""
    per_step_work, per_step_loop = work / t.count, worked / steps
    cores = os.cpu_count() or 1
    needed = math.ceil(per_step_work / per_step_loop) if per_step_loop > 0 and work > 0 else None
    workers = f"{record.workers} worker{'s' if record.workers != 1 else ''}" if record.workers else "no workers"
    if share >= INPUT_BOUND:
        sentence = f"input-bound: {share:.0%} of step time waiting"
        sentence += f"; {top_text}" if top_text else ""
        if needed is None:
            return sentence + "; the loop's own work takes no measurable time, so loading alone sets the pace"
        if needed > record.workers:
            cap = f" (this machine has {cores} cores)" if needed > cores else ""
            return sentence + f"; more workers would help up to ~{needed}{cap}"
        return sentence + (
            f"; {workers} should keep up ({per_step_work * 1e3:.1f} ms of work per {record.step} against "
            f"{per_step_loop * 1e3:.1f} ms of training): look at the transfer, the shared server or the storage"
        )
    sentence = (
        f"compute-bound: {share:.0%} of step time waiting; the loop's own work "
        f"({per_step_loop * 1e3:.1f} ms per {record.step}) sets the pace"
    )
    if needed is not None and record.workers > needed:
        sentence += f"; ~{needed} worker{'s' if needed != 1 else ''} would keep up (now {record.workers})"
    return sentence


def write(path: str | os.PathLike[str], record: RunRecord, title: str = "globalloader input report") -> Path:
    """Write the report for `record` to `path`; the path written.

    A bad path (not a path, a NUL, a folder, a name too long, no .html) is an ArgumentError; a
    folder or disk that refuses the page (read-only, full) a StorageError naming the path. The
    page goes to a temporary file first, synced and renamed over `path`, so a failed or
    interrupted write leaves the old file, or none, never half a page."""
    target = _target(path)
    page = render(record, title).encode("utf-8")
    try:
        with write_atomic(target, durable=True) as out:
            out.write(page)
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.EISDIR):
            raise ArgumentError(f"report: cannot write {str(target)!r}: {exc.strerror}") from None
        raise StorageError(
            f"report: cannot write {str(target)!r}: {exc.strerror}; free space there or choose another folder"
        ) from None
    return target


def _target(path: object) -> Path:
    """`path` as the report's Path, or an ArgumentError naming what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"report: the path must be a str or os.PathLike naming an .html file, got {path!r}")
    name = os.fspath(path)
    if not isinstance(name, str) or "\0" in name:
        raise ArgumentError(f"report: the path {name!r} must be text without NUL characters")
    target = Path(name)
    if target.suffix.lower() not in (".html", ".htm"):
        raise ArgumentError(f"report: {name!r} must end in .html (the report is one HTML page)")
    try:
        parent, folder = target.parent.is_dir(), target.is_dir()
    except OSError as exc:  # a name longer than the file system allows
        raise ArgumentError(f"report: {name!r} cannot name a file: {exc.strerror}") from None
    if not parent:
        raise ArgumentError(f"report: the folder of {name!r} does not exist")
    if folder:
        raise ArgumentError(f"report: {name!r} is a folder; name an .html file in it")
    return target


def render(record: RunRecord, title: str) -> str:
    """The report as one HTML string with its plots embedded."""
    figure = require("matplotlib.figure", "report").Figure
    t = record.timeline
    waited, worked = record.steady_wait()
    work = sum(record.stages.values())
    rows = [
        (_plural(record.step), f"{t.count:,}"),
        ("loop time waiting for data", f"{t.wait_s:.2f} s ({_share(t.wait_s, t.wait_s + t.loop_s)})"),
        ("of which the first step (start-up)", f"{t.first_wait or 0.0:.2f} s"),
        ("loop time in its own body", f"{t.loop_s:.2f} s"),
        ("waiting after the first step", _share(waited, waited + worked)),
        ("workers", str(record.workers)),
        ("worker time, all stages", f"{work:.2f} s"),
    ]
    if record.worker_idle_s is not None and work + record.worker_idle_s > 0:
        rows.append(("workers busy", _share(work, work + record.worker_idle_s)))
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    notes = "".join(f"<p class=note>{html.escape(n)}</p>" for n in record.notes)
    plots = [
        ("Throughput over time", _throughput(figure, record)),
        ("Time per stage", _stages(figure, record)),
        ("Wait per step", _histogram(figure, record)),
    ]
    images = "".join(
        f'<h2>{html.escape(name)}</h2><img alt="{html.escape(name)}" src="data:image/png;base64,{png}">'
        for name, png in plots
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p class=diagnosis>{html.escape(diagnose(record))}</p>"
        f"{notes}<table>{table}</table>{images}</body></html>"
    )


_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}"
    ".diagnosis{font-size:1.2rem;padding:.8rem 1rem;background:#f3f6fb;border-left:4px solid #3b6fb6}"
    ".note{color:#555}table{border-collapse:collapse;margin:1rem 0}"
    "th,td{padding:.2rem .8rem;border-bottom:1px solid #ddd;text-align:left}td{text-align:right}"
    "img{max-width:100%}"
)


def _plural(step: str) -> str:
    return f"{step}es" if step.endswith("ch") else f"{step}s"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "n/a"


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _throughput(figure: Any, record: RunRecord) -> str:
    t = record.timeline
    fig = figure(figsize=(8, 4.2))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    edges = [k * t.width for k in range(len(t.steps))]
    edges.append(max(t.span, edges[-1] + 1e-3) if edges else t.width)  # the last bucket ends at the last step
    rates = [n / (end - start) for n, start, end in zip(t.steps, edges, edges[1:], strict=False)]
    top.stairs(rates, edges, color="#3b6fb6", linewidth=1.5)
    top.set_ylabel(f"{_plural(record.step)}/s")
    top.grid(alpha=0.3)
    shares = [100 * w / (w + b) if w + b > 0 else 0.0 for w, b in zip(t.waits, t.loops, strict=True)]
    bottom.stairs(shares, edges, color="#c0504d", linewidth=1.5)
    bottom.set_ylim(0, 100)
    bottom.set_ylabel("% waiting")
    bottom.set_xlabel(f"seconds since the first step (buckets of {t.width:g} s)")
    bottom.grid(alpha=0.3)
    return _png(fig)


def _stages(figure: Any, record: RunRecord) -> str:
    t = record.timeline
    fig = figure(figsize=(8, 3.6))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    names = sorted(record.stages, key=lambda k: record.stages[k])
    left.barh(range(len(names)), [record.stages[n] for n in names], color="#3b6fb6")
    # Stage names are the user's map names: text, never mathtext or TeX (`$\frac{a}{$` would not draw).
    left.set_yticks(range(len(names)), [_STAGE_NAMES.get(n, n) for n in names], parse_math=False, usetex=False)
    left.set_xlabel(f"worker seconds (summed over {max(record.workers, 1)})")
    left.set_title("workers", fontsize=10)
    right.barh(["waiting for data", "own work"], [t.wait_s, t.loop_s], color=["#c0504d", "#9bbb59"])
    right.set_xlabel("loop seconds")
    right.set_title("training loop", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _histogram(figure: Any, record: RunRecord) -> str:
    edges = wait_edges()
    counts = record.timeline.histogram
    fig = figure(figsize=(8, 3.2))
    ax = fig.subplots()
    # The under- and overflow bins are drawn one decade wide at each end.
    full = [edges[0] / 10, *edges, edges[-1] * 10]
    used = [k for k, n in enumerate(counts) if n]
    lo, hi = (used[0], used[-1] + 1) if used else (0, len(counts))
    ax.stairs(counts[lo:hi], full[lo : hi + 1], fill=True, color="#3b6fb6")
    ax.set_xscale("log")
    ax.set_xlabel(f"seconds the loop waited for its next {record.step}")
    ax.set_ylabel(_plural(record.step))
    ax.grid(alpha=0.3)
    return _png(fig)

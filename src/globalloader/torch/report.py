"""`DataLoader.report()`: the torch drop-in's run as an input report (`execution.report`).

torch's worker contract gives one figure per batch: the seconds a worker spent on it (dataset
reads, transforms and collate together), so the report has one worker stage; the loop's waits are
measured per batch as for a Loader. With `share=` the drop-in runs a Loader, whose report is used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from globalloader.execution import report
from globalloader.execution.timeline import StepTimeline


def write(
    path: str | os.PathLike[str], timeline: StepTimeline, busy_s: float, workers: int, shared: Any = None
) -> Path:
    """Write the report of a DataLoader whose loop is `timeline` and whose loading took `busy_s`
    seconds (in `workers` processes, or in the loop's own thread when 0); `shared`: its Loader."""
    if shared is not None:
        return shared.report(path)
    stage = "dataset + collate (workers)" if workers else "dataset + collate (in the loop's thread)"
    record = report.RunRecord(timeline=timeline, stages={stage: busy_s}, workers=workers, step="batch")
    return report.write(path, record, title="globalloader.torch.DataLoader input report")

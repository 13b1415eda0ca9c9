"""`globalloader.torch.DataLoader.report()`: the same input report as a Loader's, from the drop-in's
own measurements, on an input-bound and a compute-bound run with real worker processes."""

from __future__ import annotations

import html
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import globalloader.torch as gt
from globalloader.execution.report import INPUT_BOUND
from helpers import Server


class Slow(torch.utils.data.Dataset):
    """Each sample takes `seconds` to load."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return torch.from_numpy(np.full(4, i))


def diagnosis(path: Path) -> str:
    return html.unescape(re.search(r"<p class=diagnosis>(.*?)</p>", path.read_text()).group(1))


@pytest.mark.parametrize("workers", [0, 2])
def test_input_bound_drop_in(tmp_path: Path, workers: int):
    loader = gt.DataLoader(Slow(64, 0.01), batch_size=4, num_workers=workers)
    for _ in loader:
        time.sleep(0.001)
    sentence = diagnosis(loader.report(tmp_path / "input-report.html"))
    loader.close()
    match = re.fullmatch(
        r"input-bound: (\d+)% of step time waiting; dataset \+ collate \((workers|in the loop's thread)\) is 100% "
        r"of worker time; more workers would help up to ~(\d+).*",
        sentence,
    )
    assert match and int(match.group(1)) >= 50 and int(match.group(3)) > max(workers, 2), sentence


def test_compute_bound_drop_in_over_two_epochs(tmp_path: Path):
    loader = gt.DataLoader(Slow(32, 0.0), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in range(2):
        for _ in loader:
            time.sleep(0.1)  # long enough for the workers to keep up on a loaded machine
    path = loader.report(tmp_path / "r.html")
    loader.close()
    sentence = diagnosis(path)
    assert sentence.startswith("compute-bound: ") and int(re.match(r"compute-bound: (\d+)%", sentence).group(1)) < (
        INPUT_BOUND * 100
    ), sentence
    assert re.search(r"<th>batches</th><td>16</td>", path.read_text()), "both epochs' batches are counted"


class Fingerprinted(Slow):
    """A dataset that says what it holds, so share=True may key its samples by it."""

    def __init__(self, n: int, seconds: float) -> None:
        super().__init__(n, seconds)
        self.fingerprint = f"slow-{n}-{seconds}"


@pytest.mark.slow
def test_shared_drop_in_reports_its_loaders_run(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the server imports this module's dataset
    server = Server(tmp_path / "s.sock")
    try:
        dataset = Fingerprinted(48, 0.01)
        loader = gt.DataLoader(dataset, batch_size=4, num_workers=1, share=True, server=str(server.socket))
        batches = sum(1 for _ in loader)
        page = loader.report(tmp_path / "shared.html").read_text()
        loader.close()
    finally:
        server.stop()
    assert batches == 12 and "<th>batches</th><td>12</td>" in page
    assert "Shared mode: the shared maps ran on the global loader server" in page

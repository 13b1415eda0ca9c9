"""`globalloader.torch.DataLoader.stats()` and `report()`: a Loader's per-stage figures and input
report, measured by the drop-in's own workers (real processes) or in the loop's thread.

Where the time goes is checked by making one stage sleep a known time and the others not: each
check bounds the sleeping stage from below by its sleep and the others by the sleeping one, so it
cannot pass with the time put in the wrong stage."""

from __future__ import annotations

import html
import json
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
        r"input-bound: (\d+)% of step time waiting; fetch \(the dataset\) is (\d+)% "
        r"of worker time; more workers would help up to ~(\d+).*",
        sentence,
    )
    assert match and int(match.group(1)) >= 50 and int(match.group(2)) >= 50, sentence
    assert int(match.group(3)) > max(workers, 2), sentence


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
        stats = loader.stats()
        loader.close()
    finally:
        server.stop()
    assert batches == 12 and "<th>batches</th><td>12</td>" in page
    assert "Shared mode: the shared maps ran on the global loader server" in page
    assert set(stats) == {"stages", "workers", "consumer", "skipped"} and stats["consumer"]["items"] == 12


ITEMS, BATCH, SLEEP = 16, 4, 0.01


class SleepyItems(torch.utils.data.Dataset):
    """`dataset[i]` sleeps `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return torch.full((4,), i)


class SleepyCollate:
    """torch's default_collate, after sleeping `seconds` per batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, samples):
        time.sleep(self.seconds)
        return torch.utils.data.default_collate(samples)


def timed_pass(workers: int, item_s: float, collate_s: float, step_s: float = 0.0, batch_size: int = BATCH) -> dict:
    loader = gt.DataLoader(
        SleepyItems(item_s), batch_size=batch_size, num_workers=workers, collate_fn=SleepyCollate(collate_s)
    )
    for _ in loader:
        time.sleep(step_s)
    loader.close()
    return loader.stats()


@pytest.mark.parametrize("workers", [0, 2])
def test_slow_getitem_is_fetch_time(workers: int):
    stats = timed_pass(workers, item_s=SLEEP, collate_s=0.0)
    stages, batches = stats["stages"], ITEMS // BATCH
    assert stages["fetch"]["items"] == ITEMS and stages["collate"]["items"] == batches
    assert stages["fetch"]["busy_s"] >= ITEMS * SLEEP > stages["collate"]["busy_s"], stages
    assert stats["workers"]["tasks"] == batches and stats["consumer"]["items"] == batches
    assert ("transport" in stages) == (workers > 0), "shared memory only between processes"
    assert stats["workers"]["busy_s"] >= stages["fetch"]["busy_s"] and stats["skipped"] == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_slow_collate_is_collate_time(workers: int):
    stats = timed_pass(workers, item_s=0.0, collate_s=BATCH * SLEEP)
    stages, batches = stats["stages"], ITEMS // BATCH
    assert stages["collate"]["items"] == batches and stages["fetch"]["items"] == ITEMS
    assert stages["collate"]["busy_s"] >= batches * BATCH * SLEEP > stages["fetch"]["busy_s"], stages


def test_loading_in_the_loops_thread_is_the_loops_wait_not_its_own_time():
    step_s = 0.02
    stats = timed_pass(0, item_s=SLEEP, collate_s=0.0, step_s=step_s)
    consumer, work = stats["consumer"], stats["stages"]["fetch"]["busy_s"] + stats["stages"]["collate"]["busy_s"]
    assert consumer["wait_s"] >= work >= ITEMS * SLEEP, stats
    # the loop's own time: the sleeps between batches (not after the last), and not the loading
    assert (ITEMS // BATCH - 1) * step_s <= consumer["busy_s"] < ITEMS * SLEEP, stats
    assert stats["workers"]["wait_s"] == 0.0


def test_workers_waiting_for_a_slow_loop_is_their_idle_time():
    step_s = 0.02
    stats = timed_pass(2, item_s=0.0, collate_s=0.0, step_s=step_s, batch_size=1)
    # 16 batches, 4 in flight: each later task is sent as the loop takes a batch, after its step
    workers = stats["workers"]
    assert workers["wait_s"] >= 4 * step_s > workers["busy_s"], stats
    assert stats["consumer"]["busy_s"] >= (ITEMS - 1) * step_s, stats


class Shuffled(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return torch.tensor([float(i), torch.rand(()).item()])  # a random augmentation, drawn in the worker


def make_shuffled(workers: int = 2) -> gt.DataLoader:
    return gt.DataLoader(
        Shuffled(), batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(3)
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_stats_and_report_leave_the_state_alone_and_a_resumed_pass_counts_what_it_loads(tmp_path: Path, workers: int):
    torch.manual_seed(7)  # without workers the augmentation draws from this process's RNG
    whole = [b.tolist() for b in make_shuffled(workers)]
    torch.manual_seed(7)
    loader = make_shuffled(workers)
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    loader.stats()
    loader.report(tmp_path / "mid.html")
    assert loader.state_dict() == state, "asking for stats or a report changes nothing a resume reads"
    assert json.loads(json.dumps(state)) == state and "stats" not in json.dumps(state)
    assert loader.stats()["consumer"]["items"] == 3

    resumed = make_shuffled(workers)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert taken + rest == whole
    stats = resumed.stats()  # the skipped batches were not loaded again: only the rest is counted
    assert stats["consumer"]["items"] == len(rest) == 5 and stats["stages"]["fetch"]["items"] == 5 * 4
    assert stats["workers"]["tasks"] == 5

    loader.load_state_dict(state)  # the same loader resumes its own state: its totals go on
    assert [b.tolist() for b in loader] == rest
    totals = loader.stats()
    assert totals["consumer"]["items"] == 3 + 5 and totals["stages"]["collate"]["items"] >= 3 + 5
    loader.close()


def test_report_of_a_drop_in_names_its_stages_and_its_workers_idle_time(tmp_path: Path):
    loader = gt.DataLoader(SleepyItems(0.0), batch_size=BATCH, num_workers=2, collate_fn=SleepyCollate(0.02))
    for _ in range(2):
        for _ in loader:
            pass
    path = loader.report(tmp_path / "collate.html")
    loader.close()
    page = path.read_text()
    assert diagnosis(path).startswith("input-bound: ") and "; collate is " in diagnosis(path), diagnosis(path)
    assert "<th>batches</th><td>8</td>" in page and "<th>workers busy</th>" in page
    assert page.count("data:image/png;base64,") == 3

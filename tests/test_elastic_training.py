"""The frameworks, for real: the scripts of docs/elastic.md run under torchrun (4, then 2, then 3
processes) and under PyTorch Lightning (one process and DDP on gloo), and each rank's batches are
checked sample by sample against the epoch's order."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "elastic.md"


def script(name: str, folder: Path) -> Path:
    """The page's example whose first line names `name`, written to `folder`."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    (code,) = [b for b in blocks if b.startswith(f"# {name}")]
    path = folder / name
    path.write_text(code)
    return path


def run(argv: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def recorded(prefix: Path, world: int) -> list[list[list[int]]]:
    """Each rank's batches, as the script appended them."""
    ranks = []
    for rank in range(world):
        path = Path(f"{prefix}.{rank}")
        ranks.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return ranks


def torchrun() -> list[str]:
    console = Path(sys.executable).with_name("torchrun")
    return [str(console)] if console.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.slow
def test_torchrun_job_restarted_with_2_then_3_processes_finishes_the_epoch_exactly(tmp_path):
    path = script("elastic_torchrun.py", tmp_path)
    order = [int(i) for i in gl.Dataset(gl.from_sequence(list(range(1200)))).shuffle(seed=0)]
    remaining, seen = order, []
    for world, stop in [(4, 10), (2, 10), (3, None)]:
        steps = ["--stop-after", str(stop)] if stop else []
        argv = [*torchrun(), "--standalone", f"--nproc-per-node={world}", str(path), "--checkpoint", "ckpt.pt"]
        run([*argv, "--record", f"seen-{world}", *steps], tmp_path)
        consumed = set()
        for rank, batches in enumerate(recorded(tmp_path / f"seen-{world}", world)):
            got = [i for b in batches for i in b]
            assert len(batches) == (stop or len(remaining[rank::world]) // 8)
            assert got == remaining[rank::world][: len(got)], f"world {world} rank {rank}: not the epoch's order"
            consumed.update(got)
            seen += got
        remaining = [i for i in remaining if i not in consumed]
    assert Counter(seen) == Counter(range(1200)), "not every sample of the epoch exactly once"


def lightning_order(loader: str, rank: int, world: int) -> list[list[int]]:
    """The batches an uninterrupted epoch gives `rank`, computed without Lightning."""
    if loader == "gl":
        chain = gl.Dataset(gl.from_sequence(list(range(480)))).shuffle(seed=0).shard(rank, world).batch(8)
        return [np.asarray(b).tolist() for b in chain]
    import torch

    sampler = torch.utils.data.DistributedSampler(list(range(480)), num_replicas=world, rank=rank, seed=0)
    sampler.set_epoch(0)
    indices = list(sampler)
    return [indices[k : k + 8] for k in range(0, len(indices), 8)]


def lightning(path: Path, argv: list[str], devices: int, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Lightning script: in this process for one device (no second import of Lightning),
    as a script for DDP (Lightning starts the other ranks by running it again)."""
    if devices > 1:
        run([sys.executable, str(path), *argv], cwd)
        return
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", [str(path), *argv])
        runpy.run_path(str(path), run_name="elastic_lightning")["main"]()


@pytest.mark.slow
@pytest.mark.parametrize(("loader", "devices"), [("gl", 1), ("torch", 1), ("gl", 2), ("torch", 2)])
def test_lightning_resumes_mid_epoch_with_exactly_the_remaining_batches(tmp_path, monkeypatch, loader, devices):
    """Stopped at step 12 (as a preemption would), resumed from the checkpoint of step 10: the
    loader's state in it is picked up, and the rest of the epoch is exactly batches 11 to the end."""
    pytest.importorskip("lightning")
    import torch

    path = script("elastic_lightning.py", tmp_path)
    common = ["--devices", str(devices), "--dir", "run", "--loader", loader]
    lightning(path, [*common, "--max-steps", "12", "--record", "first"], devices, tmp_path, monkeypatch)
    checkpoint = torch.load(tmp_path / "run" / "step=10.ckpt", weights_only=False)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"], "Lightning saved no loader state"
    lightning(path, [*common, "--resume", "run/step=10.ckpt", "--record", "second"], devices, tmp_path, monkeypatch)
    for rank, (first, second) in enumerate(
        zip(recorded(tmp_path / "first", devices), recorded(tmp_path / "second", devices), strict=True)
    ):
        assert len(first) == 12
        assert first[:10] + second == lightning_order(loader, rank, devices), f"rank {rank}: not the remaining batches"

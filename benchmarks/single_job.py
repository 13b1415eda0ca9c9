"""Single-job throughput: globalloader's Loader and its drop-in DataLoader vs torch.utils.data.DataLoader.

5,000 synthetic 500x375 JPEGs (quality 90); per sample: decode + random resized crop to 224 +
flip + normalize (`globalloader.vision.RandomResizedCropFlipNormalize`), batch 64, 2 workers, a
stand-in step that reads every batch. Three loaders alternate, `--rounds` times, one epoch each:
the chain Loader, `globalloader.torch.DataLoader` (the drop-in: the very dataset object and
arguments given to torch's class) and torch's DataLoader; the median samples/s of each is
compared with torch's. Targets: >= 1.15x DataLoader samples/s for both, first batch within 1 s.

    python benchmarks/single_job.py [--images 5000] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from globalloader import demo
from globalloader.torch import DataLoader as DropInDataLoader

RESULTS = Path(__file__).parent / "results" / "single_job.json"


def run_dropin(root: Path, workers: int = 2, batch_size: int = 64, epoch: int = 0) -> dict[str, float]:
    """One epoch through the drop-in DataLoader, built exactly as `demo.run_torch` builds torch's."""
    return demo.run_torch(root, workers, batch_size, epoch, progress=True, loader_class=DropInDataLoader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    root = demo.demo_images(args.images)
    runs: dict[str, list[dict[str, float]]] = {"globalloader": [], "dropin": [], "torch": []}
    for round_ in range(args.rounds):
        for name, run in (("globalloader", demo.run_globalloader), ("dropin", run_dropin), ("torch", demo.run_torch)):
            result = run(root, args.workers, args.batch_size, epoch=round_)
            runs[name].append(result)
            print(
                f"round {round_} {name:<12} {result['samples_per_s']:8.1f} samples/s  "
                f"first batch {result['first_batch_s']:.3f} s"
            )

    median = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    first = {name: statistics.median(r["first_batch_s"] for r in rs) for name, rs in runs.items()}
    ratio = median["globalloader"] / median["torch"]
    dropin_ratio = median["dropin"] / median["torch"]
    spread = {
        name: [min(r["samples_per_s"] for r in rs), max(r["samples_per_s"] for r in rs)] for name, rs in runs.items()
    }
    summary = {
        "benchmark": "single_job",
        "workload": "decode + random resized crop 224 + flip + normalize (float32 HWC), stand-in step reads the batch",
        "images": args.images,
        "image_size": [500, 375],
        "jpeg_quality": 90,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "rounds": args.rounds,
        "median_samples_per_s": median,
        "min_max_samples_per_s": spread,
        "median_first_batch_s": first,
        "ratio_vs_torch_dataloader": ratio,
        "dropin_ratio_vs_torch_dataloader": dropin_ratio,
        "targets": {
            "ratio >= 1.15": ratio >= 1.15,
            "dropin ratio >= 1.15": dropin_ratio >= 1.15,
            "first batch <= 1 s": first["globalloader"] <= 1.0,
        },
        "note": "2 cores; medians of alternating rounds in one invocation (loaders take turns: drift hits all alike)",
        "runs": runs,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))
    print(
        f"\nmedian samples/s: globalloader {median['globalloader']:.1f}, drop-in DataLoader "
        f"{median['dropin']:.1f}, torch DataLoader {median['torch']:.1f}"
    )
    print(
        f"ratio {ratio:.2f}x, drop-in {dropin_ratio:.2f}x (target >= 1.15x); "
        f"first batch {first['globalloader']:.3f} s (target <= 1 s)"
    )
    print(f"written {RESULTS}")


if __name__ == "__main__":
    main()

"""Single-job throughput: globalloader's Loader vs torch.utils.data.DataLoader, same functions.

5,000 synthetic 500x375 JPEGs (quality 90); per sample: decode + random resized crop to 224 +
flip + normalize (`globalloader.vision.RandomResizedCropFlipNormalize`), batch 64, 2 workers, a
stand-in step that reads every batch. The two loaders alternate, `--rounds` times, one epoch
each; the median samples/s of each is compared. Targets: >= 1.15x DataLoader samples/s, first
batch within 1 s of iteration start.

    python benchmarks/single_job.py [--images 5000] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from globalloader import demo

RESULTS = Path(__file__).parent / "results" / "single_job.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    root = demo.demo_images(args.images)
    runs: dict[str, list[dict[str, float]]] = {"globalloader": [], "torch": []}
    for round_ in range(args.rounds):
        for name, run in (("globalloader", demo.run_globalloader), ("torch", demo.run_torch)):
            result = run(root, args.workers, args.batch_size, epoch=round_)
            runs[name].append(result)
            print(f"round {round_} {name:<12} {result['samples_per_s']:8.1f} samples/s  "
                  f"first batch {result['first_batch_s']:.3f} s")

    median = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    first = {name: statistics.median(r["first_batch_s"] for r in rs) for name, rs in runs.items()}
    ratio = median["globalloader"] / median["torch"]
    summary = {
        "benchmark": "single_job",
        "workload": "decode + random resized crop 224 + flip + normalize (float32 HWC), stand-in step reads the batch",
        "images": args.images, "image_size": [500, 375], "jpeg_quality": 90,
        "batch_size": args.batch_size, "workers": args.workers, "rounds": args.rounds,
        "median_samples_per_s": median, "median_first_batch_s": first,
        "ratio_vs_torch_dataloader": ratio,
        "targets": {"ratio >= 1.15": ratio >= 1.15, "first batch <= 1 s": first["globalloader"] <= 1.0},
        "runs": runs, "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))
    print(f"\nmedian samples/s: globalloader {median['globalloader']:.1f}, torch DataLoader {median['torch']:.1f}")
    print(f"ratio {ratio:.2f}x (target >= 1.15x); first batch {first['globalloader']:.3f} s (target <= 1 s)")
    print(f"written {RESULTS}")


if __name__ == "__main__":
    main()

"""The kept listing of a folder of `--objects` (1,000,000) objects: its size, its load, its sharing.

Listing a million objects through moto here takes far too long (moto answers a page of 1,000
keys in about a second), so the listing is synthetic: `c<k>/<i>.jpg` names in 1,000 classes,
sizes around 15 KB and 32-hex ETags, handed to `FolderListing.of` by a stand-in store whose
`find` answers them (the one step left out is the LIST requests themselves). Measured:

- keep: seconds to sort, encode and write the listing (`listings/` of a fresh cache folder), and
  its bytes per object on disk;
- map: seconds for another job to use the kept listing (`listing_max_age`; the stand-in refuses
  a second `find`); seconds to construct `gl.Files` and `gl.ImageFolder` on it, in the first job
  (which passes over the names once for the machine: pattern, order, classes, labels, kept
  beside the listing) and in the next (which maps what the first kept);
- workers: a `gl.Loader` with `--workers` (2) process workers, started with fork and with spawn,
  each worker reading every name and size of the listing; per worker, from /proc/self/smaps, the
  listing file's resident bytes, the part of them private to the worker (copied: the goal is 0)
  and its proportional share (Pss: the file's pages divided among the processes mapping them);
  and the bytes a spawned worker receives for the source (its pickle: what is copied, not
  mapped).

Median of `--rounds` (3) [min, max]; JSON in benchmarks/results/folder_listing.json.

    python benchmarks/folder_listing.py [--objects 1000000] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import globalloader as gl
from globalloader import storage
from globalloader.storage.listing import FolderListing

RESULTS = Path(__file__).parent / "results" / "folder_listing.json"
ROOT = "s3://bench/folder"
OPTIONS = {"endpoint_url": "http://127.0.0.1:1"}  # never reached: the listing is kept already
CLASSES = 1000


class _Listed:
    """A store whose one listing is the synthetic folder (a second listing is a failure)."""

    def __init__(self, objects: int) -> None:
        rng = np.random.default_rng(0)
        sizes = rng.integers(10_000, 20_000, objects).tolist()
        self.storage_options, self.listed = OPTIONS, 0
        self.rows = {
            f"{ROOT}/c{i % CLASSES:04d}/{i:08d}.jpg": storage.FileStat(size, f'"{i:032x}"')
            for i, size in enumerate(sizes)
        }

    def find(self, root: str, remember: bool = True) -> dict[str, storage.FileStat]:
        self.listed += 1
        if self.listed > 1:
            raise SystemExit("the kept listing was not used: the folder was listed again")
        return self.rows


def _listing_memory(record: dict[str, Any]) -> dict[str, Any]:
    """In a worker: read every name and size of the source's listing, then what of the listing
    file this process holds (kB from /proc/self/smaps)."""
    src = record["source"]
    listing = src._listing
    names = sum(len(listing.names[i]) for i in range(len(listing)))
    total = int(np.asarray(listing.sizes).sum())
    fields: dict[str, int] = {}
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = head[-1] == str(listing.path)
            elif inside and head[0].endswith(":") and len(head) == 3 and head[2] == "kB":
                fields[head[0][:-1]] = fields.get(head[0][:-1], 0) + int(head[1])
    return {"pid": os.getpid(), "names_chars": names, "sizes_sum": total, "smaps_kb": fields}


class _WithSource:
    """A source of `n` records, each the Files source as the worker reading it has it."""

    def __init__(self, src: gl.Files, n: int) -> None:
        self.src, self.n = src, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"source": self.src}


def _round(objects: int, workers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gl-listing-bench-") as cache:
        os.environ["GLOBALLOADER_CACHE_DIR"] = cache
        store = _Listed(objects)
        t0 = time.perf_counter()
        kept = FolderListing.of(store, ROOT, max_age=3600)
        out["keep_s"] = time.perf_counter() - t0
        out["bytes_per_object"] = kept.path.stat().st_size / objects
        del kept
        t0 = time.perf_counter()
        FolderListing.of(store, ROOT, max_age=3600)
        out["map_s"] = time.perf_counter() - t0
        made: dict[str, Any] = {}
        for kind, make in (("files", gl.Files), ("image_folder", gl.ImageFolder)):
            for job in ("first", "next"):  # the first job makes its rows (and labels); the next maps them
                t0 = time.perf_counter()
                made[kind] = make(ROOT, storage_options=OPTIONS, listing_max_age=3600)
                out[f"{kind}_{job}_s"] = time.perf_counter() - t0
        files, images = made["files"], made["image_folder"]
        assert len(files) == len(images) == objects and len(images.classes) == CLASSES
        out["pickle_bytes"] = {"Files": len(pickle.dumps(files)), "ImageFolder": len(pickle.dumps(images))}
        for method in ("fork", "spawn"):
            chain = gl.Dataset(_WithSource(images, workers)).map(_listing_memory)
            with gl.Loader(chain, workers=workers, start_method=method) as loader:
                seen = {s["pid"]: s for s in loader}  # a record per task: one per worker, mostly
            assert all(s["names_chars"] and s["sizes_sum"] for s in seen.values())
            out[method] = [s["smaps_kb"] for s in seen.values()]
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds = [_round(args.objects, args.workers) for _ in range(args.rounds)]
    report: dict[str, Any] = {"objects": args.objects, "workers": args.workers, "rounds": rounds}
    keys = ("keep_s", "bytes_per_object", "map_s", "files_first_s", "files_next_s", "image_folder_first_s")
    for key in (*keys, "image_folder_next_s"):
        report[key] = _summary([r[key] for r in rounds])
    for method in ("fork", "spawn"):
        per_worker = [w for r in rounds for w in r[method]]
        report[f"{method}_worker_kb"] = {
            field: _summary([w.get(field, 0) for w in per_worker]) for field in ("Rss", "Pss", "Private_Dirty")
        }
    report["spawn_pickle_bytes"] = rounds[0]["pickle_bytes"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"kept listing of {args.objects:,} objects (median [min, max] of {args.rounds})")

    def line(label: str, figure: dict[str, float], unit: str, digits: int = 2) -> None:
        low, high = f"{figure['min']:,.{digits}f}", f"{figure['max']:,.{digits}f}"
        print(f"  {label:48} {figure['median']:,.{digits}f} [{low}, {high}] {unit}")

    line("bytes per object on disk", report["bytes_per_object"], "B", 1)
    line("list once: sort, encode, write", report["keep_s"], "s")
    line("another job: map the kept listing", report["map_s"], "s", 4)
    line("first job: gl.Files on it (makes its rows)", report["files_first_s"], "s")
    line("next job: gl.Files on it (maps its rows)", report["files_next_s"], "s", 4)
    line("first job: gl.ImageFolder (rows, labels)", report["image_folder_first_s"], "s")
    line("next job: gl.ImageFolder (maps them)", report["image_folder_next_s"], "s", 4)
    for method in ("fork", "spawn"):
        for field in ("Rss", "Pss", "Private_Dirty"):
            line(f"{method} worker: listing file {field}", report[f"{method}_worker_kb"][field], "kB", 0)
    sent = report["spawn_pickle_bytes"]
    label = "a spawned worker receives (pickle of the source)"
    print(f"  {label:48} Files {sent['Files']:,} B, ImageFolder {sent['ImageFolder']:,} B")
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()

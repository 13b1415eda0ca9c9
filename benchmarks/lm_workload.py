"""Language-model workload: tokens/s of globalloader vs Hugging Face `datasets` + torch's DataLoader vs Grain.

Data: two synthetic corpora in Parquet (`globalloader.demo.text`): "web" prose (8 files) and
"code" (4 files), document sizes lognormal in bytes (a heavy tail), row groups of 1,000 rows.
The same work in each loader, with the same byte-level tokenizer (`ByteTokenizer`, BOS/EOS):

    shuffle each corpus -> tokenize -> mix 70/30 -> pack to 2048 tokens (documents continue into
    the next row; segment ids restart per row, 0 = padding) -> batch 8 -> 2 workers

- globalloader: per corpus an exact global shuffle over the Parquet source's local Arrow copy
  (`Dataset(Parquet(...).local_copy()).shuffle()`, the copy made once before the rounds, time
  reported apart, as Hugging Face's Arrow conversion is), `.map(tokenize)`; then
  `Dataset.mix(weights)`, `.seed(0)`, `.pack(2048)`, `.batch(8)`, `Loader(workers=2)`.
  `--gl-read window` uses `shuffle(window=8)` on the Parquet source instead, `cached` a plain
  `shuffle()` on it with every row group kept decoded per worker, `global` the same with the
  default 4; `--only gl_window gl_cached ...` runs these beside the others. Where the local copy
  is not available, `cached` is the default.
- Hugging Face + torch, the fast path their documentation teaches for a torch DataLoader:
  `load_dataset("parquet")` (converted once to Arrow, before the rounds, time reported apart),
  `.to_iterable_dataset(num_shards=files)`, `.shuffle(buffer_size=1000)` (shard order plus a
  buffer: less work than a global shuffle), `interleave_datasets(probabilities=[0.7, 0.3])`,
  `.map(tokenize)`, a torch IterableDataset that packs (`pack_rows`: NumPy slices, the very rows
  `Dataset.pack` makes from the same documents), and
  `torch.utils.data.DataLoader(batch_size=8, num_workers=2)`; the files are split between workers.
- Grain: `MapDataset.source(rows).shuffle().map(tokenize)` per corpus over the Parquet files'
  text column (read once per process with pyarrow), `MapDataset.mix(weights)`,
  `.to_iter_dataset()`, `ConcatThenSplitIterDataset` (Grain's pack-and-continue), `.batch(8)`,
  `.mp_prefetch(num_workers=2)`.

Each run is a fresh process (startup included, as a user pays it) and stops after the same
number of batches (`--batches`, default 90% of a mixed epoch, so no loader runs short); tokens/s
counts non-padding tokens. Loaders take turns for `--rounds` rounds: the figures are medians with
their spread, and the ratios are between medians of the same invocation. Memory is the peak
proportional set size (PSS: shared memory counted once) of the loader's whole process tree,
sampled every 0.2 s; globalloader also runs `--epochs` full epochs in one Loader, each epoch's
peak recorded, to show that memory stays flat.

Targets: globalloader >= 2x Hugging Face + torch tokens/s, and ahead of Grain.

    python benchmarks/lm_workload.py [--web-docs 28000] [--code-docs 12000] [--rounds 3] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from globalloader._paths import cache_dir
from globalloader.demo.text import ByteTokenizer, demo_corpora

RESULTS = Path(__file__).parent / "results" / "lm_workload.json"
GL_READS = ("copy", "window", "cached", "global")
# "globalloader" reads as --gl-read says; gl_copy, gl_window, gl_global name a read explicitly.
LOADERS = ("globalloader", "hf_torch", "grain", *(f"gl_{read}" for read in GL_READS))
WEIGHTS = (0.7, 0.3)
CHILD_TIMEOUT_S = 1800


# -- memory ------------------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc (Linux)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:  # the process ended meanwhile
            continue
    return found


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """Samples the PSS of this process tree every `interval` s in a thread; `peak()` since the last reset."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval, self._peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, sum(_pss_bytes(p) for p in _tree(os.getpid())))

    def reset(self) -> int:
        """The peak so far (bytes), then start a new one."""
        peak, self._peak = max(self._peak, sum(_pss_bytes(p) for p in _tree(os.getpid()))), 0
        return peak

    def close(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.reset()


# -- the three loaders -------------------------------------------------------------------------
def pack_rows(documents: Iterable[np.ndarray], seq_len: int) -> Iterator[dict[str, np.ndarray]]:
    """Token arrays into rows of `seq_len`: a document that does not fit continues in the next row;
    segment ids count documents from 1 within each row, 0 marks padding (only in the last row);
    positions restart at 0 for each piece (as `Dataset.pack` does). The torch user's packing step."""
    tokens, segments, positions = (np.zeros(seq_len, np.int32) for _ in range(3))
    fill = segment = 0
    for doc in documents:
        start = 0
        while start < len(doc):
            take = min(seq_len - fill, len(doc) - start)
            segment += 1
            tokens[fill : fill + take] = doc[start : start + take]
            segments[fill : fill + take] = segment
            positions[fill : fill + take] = np.arange(take, dtype=np.int32)
            fill, start = fill + take, start + take
            if fill == seq_len:
                yield {"tokens": tokens, "segment_ids": segments, "positions": positions}
                tokens, segments, positions = (np.zeros(seq_len, np.int32) for _ in range(3))
                fill = segment = 0
    if fill:
        yield {"tokens": tokens, "segment_ids": segments, "positions": positions}


def globalloader_corpus(files: list[Path], read: str) -> Any:
    """One corpus, shuffled as `read` says: "copy" an exact global shuffle over the local Arrow
    copy (made once, before the rounds), "window" rows shuffled within windows of 8 row groups
    in a random group order, "cached" an exact global shuffle over Parquet with every row group
    kept decoded in each worker once read (the corpus fits in memory, as Grain's source holds it),
    "global" the same with the default cache of 4 groups (a group decode for most rows: what the
    copy, the window and the big cache avoid)."""
    import pyarrow.parquet as pq

    import globalloader as gl

    paths = [str(p) for p in files]
    groups = sum(pq.ParquetFile(p).metadata.num_row_groups for p in paths)
    source = gl.Parquet(paths, columns=["text"], cached_row_groups=groups if read == "cached" else 4)
    if read == "copy":
        return gl.Dataset(source.local_copy(cache_dir("bench", "arrow-copy"), progress=False)).shuffle()
    if read == "window":
        return gl.Dataset(source).shuffle(window=8)
    return gl.Dataset(source).shuffle()


def globalloader_batches(
    web: list[Path], code: list[Path], args: argparse.Namespace, read: str | None = None
) -> tuple[Any, Any]:
    import globalloader as gl

    tokenize = ByteTokenizer()
    corpora = [globalloader_corpus(files, read or args.gl_read).map(tokenize) for files in (web, code)]
    chain = (
        gl.Dataset.mix(corpora, weights=list(WEIGHTS)).seed(0).pack(args.seq_len, key="tokens").batch(args.batch_size)
    )
    loader = gl.Loader(chain, workers=args.workers)
    return loader, loader


def hf_corpus(files: list[Path], shards: int) -> Any:
    """One corpus as Hugging Face's fast streaming form: the Parquet files converted once to their
    Arrow cache (in this project's cache folder; made before the rounds, reused by every run),
    then `to_iterable_dataset`. Streaming the Parquet files directly (`streaming=True`) was slower
    still: its interleave sleeps 5 s each time a stream ends (a pyarrow thread-shutdown workaround)."""
    from datasets import load_dataset

    cache = str(cache_dir("bench", "hf-datasets"))
    dataset = load_dataset("parquet", data_files=[str(p) for p in files], split="train", cache_dir=cache)
    return dataset.to_iterable_dataset(num_shards=shards)


class _HFPacked:
    """The Hugging Face pipeline, packed: what a torch user wraps in an IterableDataset."""

    def __init__(self, web: list[Path], code: list[Path], seq_len: int, seed: int) -> None:
        from datasets import interleave_datasets

        streams = [hf_corpus(files, len(files)).shuffle(seed=seed, buffer_size=1000) for files in (web, code)]
        mixed = interleave_datasets(
            streams, probabilities=list(WEIGHTS), seed=seed, stopping_strategy="first_exhausted"
        )
        self.documents = mixed.map(ByteTokenizer(), remove_columns=["text"])
        self.seq_len = seq_len

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return pack_rows((np.asarray(d["tokens"], np.int32) for d in self.documents), self.seq_len)


def hf_torch_batches(web: list[Path], code: list[Path], args: argparse.Namespace) -> tuple[Any, Any]:
    import torch.utils.data  # here, so that the other loaders' processes do not carry torch's memory

    class HFPacked(_HFPacked, torch.utils.data.IterableDataset):  # type: ignore[misc]
        """What a torch user writes: the packing stream as a torch IterableDataset (workers fork)."""

    dataset = HFPacked(web, code, args.seq_len, 0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
    return loader, None


class _ParquetRows:
    """Grain's random-access source: the text column of Parquet files, read once per process (under
    a lock: Grain reads with a pool of threads, and each must not read the files again)."""

    def __init__(self, files: list[Path]) -> None:
        import pyarrow.parquet as pq

        self.files = [str(p) for p in files]
        self._len = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        self._column: Any = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, str]:
        if self._column is None:
            with self._lock:
                if self._column is None:
                    import pyarrow.parquet as pq

                    self._column = pq.read_table(self.files, columns=["text"]).column("text").combine_chunks()
        return {"text": self._column[index].as_py()}

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "_len": self._len}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _column=None, _lock=threading.Lock())


def grain_batches(web: list[Path], code: list[Path], args: argparse.Namespace) -> tuple[Any, Any]:
    import grain

    corpora = [
        grain.MapDataset.source(_ParquetRows(files)).shuffle(seed=seed).map(ByteTokenizer())
        for seed, files in enumerate((web, code))
    ]
    packed = grain.experimental.ConcatThenSplitIterDataset(
        grain.MapDataset.mix(corpora, weights=list(WEIGHTS)).to_iter_dataset(),
        length_struct={"tokens": args.seq_len},
    )
    batches = packed.batch(args.batch_size).mp_prefetch(
        grain.multiprocessing.MultiprocessingOptions(num_workers=args.workers)
    )
    return batches, None


BUILDERS = {
    "globalloader": globalloader_batches,
    **{f"gl_{read}": partial(globalloader_batches, read=read) for read in GL_READS},
    "hf_torch": hf_torch_batches,
    "grain": grain_batches,
}
SEGMENT_KEY = {name: "tokens_segment_ids" if name == "grain" else "segment_ids" for name in BUILDERS}


# -- one run in its own process ----------------------------------------------------------------
def _consume(batches: Iterable[Any], segment_key: str, limit: int | None) -> dict[str, float]:
    """Iterate (at most `limit` batches), counting non-padding tokens; a stand-in step reads each batch."""
    start = time.perf_counter()
    first = None
    tokens = count = 0
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        tokens += int(np.count_nonzero(np.asarray(batch[segment_key])))
        count += 1
        if limit is not None and count >= limit:
            break
    seconds = time.perf_counter() - start
    return {
        "batches": count,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "first_batch_s": first or 0.0,
    }


def child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measured run of loader `name` (or globalloader over `--epochs` full epochs: `epochs`)."""
    web, code = demo_corpora(args.web_docs, args.code_docs, progress=False)
    memory = PeakMemory()
    memory.reset()
    if name == "epochs":
        loader, _ = globalloader_batches(web, code, args)
        epochs = []
        with loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                result = _consume(loader, SEGMENT_KEY["globalloader"], None)
                epochs.append({**result, "peak_pss_mb": memory.reset() / 2**20})
        memory.close()
        return {"epochs": epochs}
    batches, closer = BUILDERS[name](web, code, args)
    result = _consume(batches, SEGMENT_KEY[name], args.batches)
    if closer is not None:
        closer.close()
    return {**result, "peak_pss_mb": memory.close() / 2**20}


def run_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", name, *_shared_flags(args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shared_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--web-docs", args.web_docs, "--code-docs", args.code_docs, "--workers", args.workers]
    flags += ["--seq-len", args.seq_len, "--batch-size", args.batch_size, "--epochs", args.epochs]
    flags += ["--batches", args.batches, "--gl-read", args.gl_read]
    return [str(f) for f in flags]


def _mixed_epoch_batches(web: list[Path], code: list[Path], seq_len: int, batch_size: int) -> int:
    """Batches in one epoch mixed 70/30 until the first corpus runs out (tokens counted from the files)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    per_corpus = []
    for files in (web, code):
        lengths = pc.binary_length(pq.read_table([str(p) for p in files], columns=["text"]).column("text"))
        per_corpus.append((len(lengths), pc.sum(lengths).as_py() + 2 * len(lengths)))
    documents = min(n / w for (n, _), w in zip(per_corpus, WEIGHTS, strict=True))
    tokens = sum(w * documents * total / n for (n, total), w in zip(per_corpus, WEIGHTS, strict=True))
    return int(tokens // (seq_len * batch_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--web-docs", type=int, default=28000)
    parser.add_argument("--code-docs", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=0, help="batches per run (default: 90%% of a mixed epoch)")
    parser.add_argument("--only", nargs="*", choices=LOADERS, default=list(LOADERS[:3]))
    parser.add_argument("--gl-read", choices=GL_READS, default=None, help="default: copy when available, else cached")
    parser.add_argument("--child", choices=[*LOADERS, "epochs"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.gl_read = args.gl_read or _default_gl_read()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    web, code = demo_corpora(args.web_docs, args.code_docs)
    epoch_batches = _mixed_epoch_batches(web, code, args.seq_len, args.batch_size)
    # One-time conversions, made before the rounds and reused by every run; a copy or Arrow cache
    # left by an earlier invocation is reused too, so a time near zero means it was already there.
    prepare_s = {}
    if "hf_torch" in args.only:
        start = time.perf_counter()
        for files in (web, code):
            hf_corpus(files, len(files))
        prepare_s["hf_arrow_cache"] = time.perf_counter() - start
    if "gl_copy" in args.only or ("globalloader" in args.only and args.gl_read == "copy"):
        start = time.perf_counter()
        for files in (web, code):
            globalloader_corpus(files, "copy")
        prepare_s["globalloader_arrow_copy"] = time.perf_counter() - start
    args.batches = args.batches or int(0.9 * epoch_batches)
    print(f"{args.batches} batches per run ({epoch_batches} in a mixed epoch), {args.rounds} rounds")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.only}
    for round_ in range(args.rounds):
        for name in args.only:
            result = run_child(name, args)
            runs[name].append(result)
            print(
                f"round {round_} {name:<12} {result['tokens_per_s'] / 1e6:7.2f} M tokens/s  "
                f"first batch {result['first_batch_s']:.2f} s  peak PSS {result['peak_pss_mb']:.0f} MB"
            )
    epochs = run_child("epochs", args)["epochs"] if "globalloader" in args.only else []
    for e, result in enumerate(epochs):
        print(
            f"globalloader epoch {e}: {result['tokens_per_s'] / 1e6:.2f} M tokens/s, "
            f"peak PSS {result['peak_pss_mb']:.0f} MB"
        )

    median = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    spread = {
        name: [min(r["tokens_per_s"] for r in rs), max(r["tokens_per_s"] for r in rs)] for name, rs in runs.items()
    }
    ours = [n for n in runs if n == "globalloader" or n.startswith("gl_")]
    ratios = {f"{g}/{n}": median[g] / median[n] for g in ours for n in runs if n not in ours}
    targets = {}
    if "globalloader/hf_torch" in ratios:
        targets["globalloader >= 2x hf_torch"] = ratios["globalloader/hf_torch"] >= 2.0
    if "globalloader/grain" in ratios:
        targets["globalloader > grain"] = ratios["globalloader/grain"] > 1.0
    if epochs:
        peaks = [e["peak_pss_mb"] for e in epochs]
        targets["memory flat across epochs (last epoch peak <= first's + 10%)"] = peaks[-1] <= 1.1 * peaks[0]
    summary = {
        "benchmark": "lm_workload",
        "workload": "shuffle, byte-level tokenize (BOS/EOS), mix web/code 70/30, pack 2048, batch 8, 2 workers",
        "corpora": {"web_documents": args.web_docs, "code_documents": args.code_docs, "files": [len(web), len(code)]},
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "batches_per_run": args.batches,
        "batches_per_mixed_epoch": epoch_batches,
        "rounds": args.rounds,
        "globalloader_read": args.gl_read,
        "one_time_preparation_s": prepare_s,
        "median_tokens_per_s": median,
        "min_max_tokens_per_s": spread,
        "ratios_of_medians": ratios,
        "median_peak_pss_mb": {name: statistics.median(r["peak_pss_mb"] for r in rs) for name, rs in runs.items()},
        "globalloader_epochs": epochs,
        "targets": targets,
        "versions": _versions(),
        "note": "2 shared cores; each run a fresh process; loaders take turns each round (drift hits all alike)",
        "runs": runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))
    print("median M tokens/s: " + ", ".join(f"{n} {v / 1e6:.2f}" for n, v in median.items()))
    print("ratios: " + ", ".join(f"{n} {v:.2f}x" for n, v in ratios.items()) + f"; targets {targets}")
    print(f"written {RESULTS}")


def _default_gl_read() -> str:
    import globalloader as gl

    return "copy" if hasattr(gl.Parquet, "local_copy") else "cached"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("globalloader", "datasets", "torch", "grain", "pyarrow", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "absent"
    return found


if __name__ == "__main__":
    main()

"""A training job for the service tests, run as its own process: `python job.py SOCKET OUT ...`.

It loads a shared dataset through `Loader(share=...)`, writes every index it yields (one line
per batch, flushed, so a test can watch it and kill it mid-epoch) and its final stats to OUT.
The shared map is defined here, in __main__, so it reaches the server by value.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import numpy as np

import globalloader as gl

SIZE = 300  # the dataset: indices 0..299


def decode(record):
    """The shared prefix: 'decodes' index i to a 32x32x3 image; index 13 is corrupt."""
    if record == 13:
        raise ValueError("corrupt JPEG data in sample 13")
    return {"image": np.full((32, 32, 3), record % 251, np.uint8), "index": record}


def slow_decode(record):
    """`decode` taking 0.1 s per sample: loads stay in flight long enough to be seen."""
    time.sleep(0.1)
    return decode(record)


def augment(sample, rng):
    return {"image": sample["image"].astype(np.float32) + rng.random(), "index": sample["index"]}


def chain(indices: list[int], batch: int, slow: bool = False) -> gl.Dataset:
    ds = gl.Dataset(gl.from_sequence(list(range(SIZE))))
    shared = slow_decode if slow else decode
    return ds.select(indices).shuffle(seed=0).map(shared, shared=True).map(augment).batch(batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("out")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--stop", type=int, default=SIZE)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per batch (a slow job)")
    p.add_argument("--slow-decode", action="store_true", help="the shared map takes 0.1 s per sample")
    p.add_argument("--share", default="true")
    p.add_argument("--on-error", default="raise")
    p.add_argument("--hold-gil-at", type=int, default=-1, help="after this batch, hold the GIL for 8 s")
    p.add_argument("--pause-at", type=int, default=-1, help="after this batch, wait for OUT.go to exist")
    p.add_argument("--name", default=None, help="the job's name in `globalloader status`")
    args = p.parse_args()
    share = {"true": True, "auto": "auto"}[args.share]
    indices = list(range(args.start, args.stop))
    with (
        open(args.out, "w") as out,
        gl.Loader(
            chain(indices, args.batch, args.slow_decode),
            workers=1,
            share=share,
            server=args.socket,
            on_error=args.on_error,
            name=args.name,
        ) as loader,
    ):
        try:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                for k, batch in enumerate(loader):
                    out.write(json.dumps({"epoch": epoch, "indices": [int(i) for i in batch["index"]]}) + "\n")
                    out.flush()
                    time.sleep(args.sleep)
                    if k == args.hold_gil_at:
                        ctypes.PyDLL(None).sleep(8)  # a C call that keeps the GIL: no heartbeat
                    if k == args.pause_at:
                        out.write(json.dumps({"paused": k}) + "\n")
                        out.flush()
                        while not os.path.exists(args.out + ".go"):
                            time.sleep(0.05)
            out.write(json.dumps({"stats": loader.stats()["skipped"]}) + "\n")
        except gl.errors.GlobalLoaderError as exc:
            out.write(json.dumps({"error": type(exc).__name__, "message": str(exc)}) + "\n")


if __name__ == "__main__":
    main()

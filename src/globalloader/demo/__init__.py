"""`globalloader demo` and the workloads it shares with `benchmarks/`.

- `workload`: the single-job workload (synthetic JPEGs, the ImageNet train transform, one epoch
  through `gl.Loader` or torch's DataLoader); `benchmarks/single_job.py` runs it too.
- `jobs`: the multi-job workload (K job processes, independent or through one server);
  `benchmarks/multi_job.py` runs it too.
- `text`: the language-model workload's data (synthetic web and code corpora in Parquet, a
  byte-level tokenizer); `benchmarks/lm_workload.py` and the README's LM example use it.
- `remote`: the third act: three jobs over tar shards in a local S3 server, without and with the
  machine-wide cache; `s3`: that server (moto's, on loopback) and a byte-counting, fault-injecting
  proxy, which `benchmarks/remote.py` and the tests use too.
- `report`: the command itself: the three acts, each figure the median of several runs with its spread.

Nothing in the library imports this package; it sits above the Loader and the service.
"""

from globalloader.demo.report import main
from globalloader.demo.workload import demo_images, run_globalloader, run_torch, train_chain, train_step

__all__ = ["demo_images", "main", "run_globalloader", "run_torch", "train_chain", "train_step"]
assert __all__ == sorted(__all__)

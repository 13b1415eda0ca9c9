"""`globalloader demo` and the workloads it shares with `benchmarks/`.

- `workload`: the single-job workload (`benchmarks/single_job.py` runs it too);
- `jobs`: the multi-job workload (`benchmarks/multi_job.py`);
- `text`: the language-model workload's data (`benchmarks/lm_workload.py`, the README's LM example);
- `remote`: the third act, over a local S3 server (`s3`; `benchmarks/remote.py` and tests use it);
- `report`: the command itself: the three acts, each figure the median of runs with its spread.

Nothing in the library imports this package; it sits above the Loader and the service.
"""

from globalloader.demo.report import main
from globalloader.demo.workload import demo_images, run_globalloader, run_torch, train_chain, train_step

__all__ = ["demo_images", "main", "run_globalloader", "run_torch", "train_chain", "train_step"]
assert __all__ == sorted(__all__)

"""Global per-epoch shuffle across machines on a Ray cluster (the `globalloader[ray]` extra).

`ShufflingDataset` yields dicts of NumPy arrays; `globalloader.ray.torch` has the PyTorch form.
Importing this package without Ray installed raises MissingExtraError naming the extra.
"""

from globalloader._extras import require

require("ray", "ray")
require("pyarrow", "ray")

from globalloader.ray.dataset import ShufflingDataset  # noqa: E402 - only once the extras are known to be there

__all__ = ["ShufflingDataset"]
assert __all__ == sorted(__all__)

"""PyTorch adapters: a drop-in `DataLoader`, tensors out, torch datasets in.

Switching a training script is one line:

    from globalloader.torch import DataLoader   # was: from torch.utils.data import DataLoader

Images can travel as uint8 (`RandomResizedCropFlipNormalize(normalize=False)`) and be normalized
on the device with `normalize_batch`.
"""

from globalloader.torch.dataloader import DataLoader
from globalloader.torch.normalize import normalize_batch
from globalloader.torch.source import IterableDataset, TorchSource
from globalloader.torch.tensors import collate, to_tensors

__all__ = ["DataLoader", "IterableDataset", "TorchSource", "collate", "normalize_batch", "to_tensors"]
assert __all__ == sorted(__all__)

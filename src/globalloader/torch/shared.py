"""`DataLoader(..., share=True)`: the job runs as a `globalloader.Loader` fed by the machine's
global loader server, which reads and decodes each sample once for every job sharing it.

Only what the chain model expresses is accepted (map-style dataset with a `fingerprint`,
batch_size, shuffle, drop_last, collate_fn, num_workers, timeout, generator as the shuffle seed);
anything else is refused by name rather than run with different semantics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from globalloader.dataset.chain import Dataset
from globalloader.dataset.collate import collate as numpy_collate
from globalloader.errors import ArgumentError
from globalloader.execution.loader import Loader
from globalloader.sources.base import declared_fingerprint
from globalloader.torch.source import TorchSource, missing_fingerprint
from globalloader.torch.tensors import torch

if TYPE_CHECKING:
    from globalloader.torch.settings import LoaderSettings


def shared_loader(dl: LoaderSettings, share: bool | str, server: str | None) -> Loader:
    """The chain Loader behind a shared DataLoader (its batches are NumPy: `to_tensors` makes them torch's)."""
    unsupported = {
        "an IterableDataset": dl._dataset_kind_iterable,
        "sampler=": not isinstance(dl.sampler, (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)),
        "batch_sampler=": dl.batch_size is None,
        "worker_init_fn=": dl.worker_init_fn is not None,
        "persistent_workers=": dl.persistent_workers,
        "multiprocessing_context=": dl.multiprocessing_context is not None,
    }
    refused = [name for name, bad in unsupported.items() if bad]
    if refused:
        raise ArgumentError(
            f"DataLoader(share={share!r}) runs the chain Loader, which cannot honour {', '.join(refused)}; "
            "drop share= to get torch's semantics, or drop those arguments"
        )
    if declared_fingerprint(dl.dataset) is None:
        raise ArgumentError(f"DataLoader(share={share!r}): {missing_fingerprint(dl.dataset)}")
    chain = Dataset(TorchSource(dl.dataset))
    if isinstance(dl.sampler, torch.utils.data.RandomSampler):
        seed = 0 if dl.generator is None else dl.generator.initial_seed()
        chain = chain.shuffle(seed)
    chain = chain.map(_as_loaded, shared=True, name="dataset[i]")  # the server loads each sample once
    default = dl.collate_fn is torch.utils.data.default_collate
    chain = chain.batch(dl.batch_size or 1, drop_last=dl.drop_last, collate=numpy_collate if default else dl.collate_fn)
    prefetch = (dl.prefetch_factor or 2) * dl.num_workers if dl.num_workers else None
    timeout = dl.timeout if dl.timeout > 0 else 300.0
    return Loader(chain, workers=dl.num_workers, prefetch=prefetch, timeout=timeout, share=share, server=server)


def _as_loaded(sample: Any) -> Any:
    """The sample as `dataset[i]` returned it: the shared part of the chain is the loading itself."""
    return sample

"""The chain: `Dataset` and its operators (select, shuffle, shard, map, cache, batch, stream)."""

from globalloader.dataset.chain import Dataset
from globalloader.dataset.collate import collate
from globalloader.dataset.iterator import DatasetIterator

__all__ = ["Dataset", "DatasetIterator", "collate"]
assert __all__ == sorted(__all__)

"""Sources: records addressable by integer index: `len(src)`, `src[i] -> dict`, `.fingerprint`."""

from globalloader.sources._arrow_values import to_numpy  # the one Arrow -> NumPy rule, for engines reading Arrow blocks
from globalloader.sources.arrow_copy import ArrowCopy
from globalloader.sources.base import Source
from globalloader.sources.fields import DecodeFields
from globalloader.sources.files import Files
from globalloader.sources.hf import HFDataset
from globalloader.sources.image_folder import ImageFolder
from globalloader.sources.lit_chunks import LitData
from globalloader.sources.mds import MDS
from globalloader.sources.parquet import Parquet
from globalloader.sources.parquet_writer import ParquetWriter
from globalloader.sources.sequence import from_sequence
from globalloader.sources.tar_shards import TarShards
from globalloader.sources.tar_writer import TarWriter

__all__ = [  # noqa: RUF022  # sorted as sorted() sorts (ruff would put the all-caps MDS first)
    "ArrowCopy",
    "DecodeFields",
    "Files",
    "HFDataset",
    "ImageFolder",
    "LitData",
    "MDS",
    "Parquet",
    "ParquetWriter",
    "Source",
    "TarShards",
    "TarWriter",
    "from_sequence",
    "to_numpy",
]
assert __all__ == sorted(__all__)

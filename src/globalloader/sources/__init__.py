"""Sources: records addressable by integer index: `len(src)`, `src[i] -> dict`, `.fingerprint`."""

from globalloader.sources.arrow_copy import ArrowCopy
from globalloader.sources.base import Source
from globalloader.sources.fields import DecodeFields
from globalloader.sources.files import Files
from globalloader.sources.image_folder import ImageFolder
from globalloader.sources.parquet import Parquet
from globalloader.sources.sequence import from_sequence
from globalloader.sources.tar_shards import TarShards
from globalloader.sources.tar_writer import TarWriter

__all__ = [
    "ArrowCopy",
    "DecodeFields",
    "Files",
    "ImageFolder",
    "Parquet",
    "Source",
    "TarShards",
    "TarWriter",
    "from_sequence",
]
assert __all__ == sorted(__all__)

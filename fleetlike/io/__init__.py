"""``fleetlike.io``: data input for distributed training (Light's ``io``, Paddle's image lists).

API summary (everything defaults ``num_replicas``/``rank``/device to the fleet job's):

===========================================================  ===================================
``get_data_loader(dataset, batch_size, num_replicas=None,    torch DataLoader parameters plus a
rank=None, shuffle=True, *, seed, tail, block_size,          resumable sampler, prefetch of
blocks_per_window, sampler,
num_workers, collate_fn, pin_memory, drop_last, timeout,     ``prefetch`` batches onto the
worker_init_fn, multiprocessing_context, generator,          device, and the data-wait time;
prefetch_factor, persistent_workers, prefetch=2, device,     returns a `DistributedDataLoader`
batch_sampler, enable_optimizations=True)``                  (torch's DataLoader when False)
(alias ``get_dataloader``, Light's other spelling)
``DistributedDataLoader``                                    iterate; ``set_epoch(e)``;
                                                             ``state_dict()`` /
                                                             ``load_state_dict()``;
                                                             ``last_wait`` / ``epoch_wait``
                                                             (seconds waited on data: last step,
                                                             this pass), ``steps``, ``skipped``
``DistributedSampler(dataset, num_replicas=None, rank=None,  torch's, resumable:
shuffle=True, seed=0, drop_last=False, *, tail, batch_size,  ``set_epoch``, ``state_dict()``,
block_size=None, blocks_per_window=8)``                      ``load_state_dict()`` (any world
                                                             size); ``tail`` pad / drop / even;
                                                             ``block_size``: block shuffle
``files_shard(files, size=None, rank=None, drop_last=False)``  this rank's contiguous block
``worker_shard``, ``FileShardDataset(files, read)``          by rank and DataLoader worker
``FileCache(source, cache_dir, max_bytes=None, reader=None)``  raw files of a slow source, fetched
``get_file(path, *, source, cache_dir, max_bytes=None)``       once per node (LRU by bytes, atomic,
``set_file_cache(cache)``, then ``get_file(path)`` (Light's)  one fetch when processes race)
``CachedDataset(dataset, cache_type="memory", cache_dir=None,  decoded samples in memory / on disk
cache_size=None, transforms=None, *, disk_size=None)``         / auto; ``transforms`` (random
                                                             augmentation) after the cache
``ImageListDataset(root, list_file, transform=None, ...)``   Paddle's ``path label`` lists
``ImageFolder(root, transform=None, ...)``                   ``root/<class>/<image>``; both take
                                                             ``file_cache=`` and ``cache_type=``,
                                                             ``cache_dir``, ``cache_size``,
                                                             ``cache_transform`` (decoded cache)
``IndexTFRDataset(tfrecord_dir, tfrecord_file, transform,   TI-ACC's packed images: TFRecord
..., readahead_block=None)``
``build_index``, ``read_index``, ``RecordError``             files read through an index (tools:
                                                             ``python -m fleetlike.io.tools.
                                                             image_list`` / ``img2tfrecord``)
``Decoder(name="auto")``, ``available_decoders()``           the fastest installed JPEG decoder
``LightDataset`` (base class), ``files_cache``               Light's cached datasets; a dataset's
                                                             ``files_path_list`` for ``get_file``
``fleetlike.io.light``                                       Light's ``get_data_loader`` order
                                                             and defaults, Light's ImageFolder
``Compose``, ``ToTensor``, ``Normalize``, ``Resize``,        torchvision's transforms on Pillow
``CenterCrop``, ``RandomResizedCrop``, ``RandomHorizontalFlip``,  (any callable works as well)
``PILToTensor``, ``ConvertImageDtype``
===========================================================  ===================================

Every step's wait for its batch is also recorded for fleetlike's slow-rank report
(``DistributedStrategy.slow_rank_check``), which names a rank whose input pipeline is slow.

Example:
    >>> from fleetlike import fleet, io
    >>> fleet.init()
    >>> ds = io.ImageListDataset("data", "data/train.txt", transform=io.ToTensor())
    >>> loader = io.get_data_loader(ds, 32, num_workers=4)
    >>> fleet.register_state("loader", loader)        # a restart continues the epoch
    >>> for epoch in range(epochs):
    ...     loader.set_epoch(epoch)
    ...     for x, y in loader: ...
"""

from fleetlike.io.cached import CachedDataset, CacheType, sample_bytes
from fleetlike.io.decode import Decoder, DecoderName, available_decoders
from fleetlike.io.datasets import DataRootError, IMAGE_EXTENSIONS, ImageFolder, ImageListDataset, ImageReadError, OnError, read_image_list
from fleetlike.io.file_cache import FileCache, ThrottledReader, files_cache, get_file, read_chunks, set_file_cache
from fleetlike.io.light_dataset import LightDataset
from fleetlike.io.loader import DistributedDataLoader, Skipped, get_data_loader, get_dataloader, to_device
from fleetlike.io.sampler import DistributedSampler, Tail
from fleetlike.io.shard import FileShardDataset, files_shard, worker_shard
from fleetlike.io.records import RecordError
from fleetlike.io.store import CacheFullError
from fleetlike.io.tfrecord import IndexTFRDataset, build_index, read_index
from fleetlike.io.transforms import (
    CenterCrop,
    Compose,
    ConvertImageDtype,
    Normalize,
    PILToTensor,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "CacheFullError",
    "CacheType",
    "CachedDataset",
    "CenterCrop",
    "Compose",
    "ConvertImageDtype",
    "DataRootError",
    "Decoder",
    "DecoderName",
    "DistributedDataLoader",
    "DistributedSampler",
    "FileCache",
    "FileShardDataset",
    "ImageFolder",
    "ImageListDataset",
    "ImageReadError",
    "IndexTFRDataset",
    "LightDataset",
    "Normalize",
    "OnError",
    "PILToTensor",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RecordError",
    "Resize",
    "Skipped",
    "Tail",
    "ThrottledReader",
    "ToTensor",
    "available_decoders",
    "build_index",
    "files_cache",
    "files_shard",
    "get_data_loader",
    "get_dataloader",
    "get_file",
    "read_chunks",
    "read_index",
    "read_image_list",
    "sample_bytes",
    "set_file_cache",
    "to_device",
    "worker_shard",
]

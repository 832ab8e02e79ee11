"""Rebuilding a DataLoader with another batch size or sampler, keeping everything else.

The loader the user passes carries the *global* batch size (strong scaling, as ATorch):
accumulation splits it into micro-batches, data parallelism into per-rank batches.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from composable_atorch.errors import ConfigError, DatasetSizeError

_KEEP = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
)


def loader_batch_size(loader: DataLoader) -> int:
    if loader.batch_size is None:
        raise ConfigError(
            "loader.batch_size", None, "a DataLoader built with batch_size= (a custom batch_sampler cannot be split)"
        )
    return loader.batch_size


def dataset_size(loader: Any) -> int | None:
    """The number of samples of a map-style loader's dataset; None when it has no length (iterable)."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:  # a map-style dataset without __len__: nothing to check
        return None


def first_length(loader: Any) -> int | None:
    """The sequence length of the loader's first sample (map-style datasets: a tensor of ids, a dict
    holding ``input_ids``, or a tuple whose first item is either); None when it cannot be read without
    consuming the loader (iterable datasets) or the sample holds no sequence."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - an unindexable dataset: its length is seen at the first batch
        return None
    first = sample[0] if isinstance(sample, list | tuple) and sample else sample
    if isinstance(first, dict):
        first = first.get("input_ids")
    return first.size(0) if hasattr(first, "dim") and first.dim() >= 1 else None


def check_dataset_size(loader: Any) -> None:
    """DatasetSizeError for an empty dataset or one smaller than the global batch, before any work.

    Such a loader trains 0 steps with ``drop_last`` and one short batch (padded with repeats
    across ranks) without it, and says nothing either way.
    """
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return
    samples = dataset_size(loader)
    batch = getattr(loader, "global_batch_size", loader.batch_size)
    if samples is not None and (samples == 0 or samples < batch):
        raise DatasetSizeError(samples, batch)


def padding_note(samples: int | None, ranks: int, drop_last: bool) -> str | None:
    """What DistributedSampler does to a dataset that does not divide over the ranks, for explain()."""
    if samples is None or samples % ranks == 0:
        return None
    if drop_last:
        return f"drops the last {samples % ranks} of {samples} samples each epoch so they divide over {ranks} ranks"
    pad = -samples % ranks
    return (
        f"pads {samples} samples with {pad} repeat(s) of the first so they divide over {ranks} ranks: "
        f"{pad} sample(s) count twice each epoch"
    )


def is_shuffled(loader: DataLoader) -> bool:
    return isinstance(loader.sampler, RandomSampler)


def split_batch(loader: DataLoader, parts: int, *, what: str) -> int:
    """The batch size after splitting the loader's batch into ``parts``; ConfigError if it does not divide."""
    batch = loader_batch_size(loader)
    if parts < 1 or batch % parts:
        raise ConfigError(what, parts, f"a divisor of the loader's batch size {batch}")
    return batch // parts


def fitting_worlds(batch: int, others: int, limit: int = 8) -> list[int]:
    """World sizes at which ``batch`` divides over the data size: ``others`` (the product of the
    non-data sizes) times each divisor of the batch, smallest first (at most ``limit``)."""
    return [others * d for d in range(1, batch + 1) if batch % d == 0][:limit]


def check_global_batch(loader: DataLoader, layout: Any) -> int:
    """The global batch; ConfigError naming the world sizes that would work when it does not divide
    over the layout's data size (the global batch is kept at any world size: it is the math)."""
    batch, parts = loader_batch_size(loader), layout.batch_split
    if batch % parts:
        others = layout.world_size // parts
        raise ConfigError(
            "loader batch_size (the global batch)",
            batch,
            f"a multiple of the data-parallel size {parts} ({layout.describe()}): the global batch is split into "
            f"{parts} equal per-rank batches and is kept at any world size; world sizes where {batch} divides: "
            f"{', '.join(map(str, fitting_worlds(batch, others)))}",
        )
    return batch


def split_over_data(loader: DataLoader, layout: Any, rank: int, *, distributed: bool, sampler_cls=None):
    """``(loader, per-rank batch)``: the global batch split over the layout's data dimension.

    The sampler is a ``DistributedSampler`` (or ``sampler_cls``) over the data ranks whenever a
    process group exists, *also at a data size of 1*: its order (a permutation drawn from its seed
    and the epoch, read by rank ``r`` at positions ``r, r + n, ...``) is the same global order at
    every data size, so a run resumed at another world or layout continues that order (see
    runtime/resumable.py); and every rank of a tensor or pipeline group reads the same samples
    without relying on equal RNG states. Without a process group (one process, not launched) the
    loader is left as it is. The split is refused, naming the world sizes that would work, when the
    global batch does not divide over the data size: changing the global batch changes the math.
    """
    from torch.utils.data.distributed import DistributedSampler

    parts = layout.batch_split
    if parts == 1 and not distributed:
        return loader, loader_batch_size(loader)
    if isinstance(loader.sampler, DistributedSampler):
        raise ConfigError(
            "loader.sampler",
            type(loader.sampler).__name__,
            "a plain sampler: pass the loader with the global batch; the plan adds the distributed sampler",
        )
    batch = check_global_batch(loader, layout)
    sampler = (sampler_cls or DistributedSampler)(
        loader.dataset,
        num_replicas=parts,
        rank=layout.batch_rank(rank),
        shuffle=is_shuffled(loader),
        drop_last=bool(loader.drop_last),
    )
    return rebuild_loader(loader, batch_size=batch // parts, sampler=sampler), batch // parts


def rebuild_loader(loader: DataLoader, *, batch_size: int | None = None, sampler: Any = None) -> DataLoader:
    """The same loader with a new batch size and/or sampler; every other setting kept."""
    if isinstance(loader.batch_sampler, BatchSampler) is False and loader.batch_size is None:
        raise ConfigError(
            "loader.batch_sampler", type(loader.batch_sampler).__name__, "a DataLoader built with batch_size="
        )
    kwargs = {k: getattr(loader, k) for k in _KEEP if hasattr(loader, k)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("multiprocessing_context", None)
        kwargs.pop("persistent_workers", None)
        kwargs.pop("timeout", None)
    kwargs.pop("prefetch_factor", None)
    if sampler is None:
        sampler = loader.sampler if not isinstance(loader.sampler, SequentialSampler) else None
    new = DataLoader(
        loader.dataset,
        batch_size=batch_size if batch_size is not None else loader.batch_size,
        sampler=sampler,
        **kwargs,
    )
    # let later rebuilds (and checks) know what the user asked for originally
    new.global_batch_size = getattr(loader, "global_batch_size", loader.batch_size)
    return new

"""Which tokens of each sequence a rank holds, and the loader's batch split that gives them to it.

Context parallelism splits a sequence of length ``T`` into ``2n`` chunks and gives rank ``i``
chunks ``i`` and ``2n-1-i`` (*load balancing*): under a causal mask the early chunks attend to
few keys and the late ones to many, so pairing them gives every rank the same work. Ulysses
splits contiguously (``T/n`` tokens per rank): after its all-to-all every rank attends over the
whole sequence, so no balancing is needed. Positions stay global: :func:`chunk_positions` is the
global position of each local token, passed to the model as ``position_ids`` and used by the
attention's causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from composable_atorch.errors import ConfigError


def chunk_positions(rank: int, n: int, local_len: int, balanced: bool, device=None) -> torch.Tensor:
    """The global positions of the ``local_len`` tokens rank ``rank`` of ``n`` holds (int64, 1-D)."""
    if not balanced:
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    s = local_len // 2
    first = torch.arange(rank * s, (rank + 1) * s, device=device)
    second = torch.arange((2 * n - 1 - rank) * s, (2 * n - rank) * s, device=device)
    return torch.cat([first, second])


def all_positions(n: int, local_len: int, balanced: bool, device=None) -> torch.Tensor:
    """The global positions of the keys gathered from ranks ``0..n-1`` in rank order."""
    return torch.cat([chunk_positions(r, n, local_len, balanced, device) for r in range(n)])


def check_length(total: int, n: int, balanced: bool, who: str) -> None:
    """ConfigError when a sequence of ``total`` tokens does not split into this layout's chunks."""
    parts = 2 * n if balanced else n
    if total % parts:
        how = f"2 x {n} load-balanced chunks" if balanced else f"{n} equal parts"
        raise ConfigError(
            f"{who}: sequence length", total, f"a multiple of {parts} (each sequence is split into {how}); pad it"
        )


def _shard(t: torch.Tensor, rank: int, n: int, balanced: bool, seq_len: int, who: str) -> torch.Tensor:
    if t.dim() < 2 or t.size(1) != seq_len:
        return t
    check_length(seq_len, n, balanced, who)
    index = chunk_positions(rank, n, seq_len // n, balanced, device=t.device)
    return t.index_select(1, index)


def _seq_len(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.size(1) if batch.dim() >= 2 else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, list | tuple) else ()
    for item in items:
        found = _seq_len(item)
        if found is not None:
            return found
    return None


def shard_batch(batch: Any, rank: int, n: int, balanced: bool, who: str, seq_len: int | None = None) -> Any:
    """This rank's part of every ``(batch, seq, ...)`` tensor in a batch (tensors, tuples, lists, dicts).

    The sequence length is the first tensor's dimension 1; tensors of another length (per-sample
    values) are kept whole. A dict with ``labels`` is refused: transformers' causal LM losses shift
    labels inside the model, which would pair the last token of one chunk with the first of the next.
    """
    seq_len = _seq_len(batch) if seq_len is None else seq_len
    if seq_len is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return _shard(batch, rank, n, balanced, seq_len, who)
    if isinstance(batch, dict):
        if "labels" in batch:
            raise ConfigError(
                f"{who}: batch key",
                "labels",
                "targets already shifted by one, e.g. (input_ids, targets) pairs as TextDataset gives: the model "
                "would shift labels inside each rank's part of the sequence",
            )
        return {k: shard_batch(v, rank, n, balanced, who, seq_len) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        parts = [shard_batch(v, rank, n, balanced, who, seq_len) for v in batch]
        return type(batch)(parts) if not hasattr(batch, "_fields") else type(batch)(*parts)
    return batch


@dataclass
class ShardCollate:
    """The loader's collate function followed by :func:`shard_batch` (picklable, for worker processes)."""

    collate: Any
    rank: int
    n: int
    balanced: bool
    who: str

    def __call__(self, samples):
        return self.shard(self.collate(samples))

    def shard(self, batch):
        """This rank's part of a collated batch (the estimator feeds its batch through this too)."""
        return shard_batch(batch, self.rank, self.n, self.balanced, self.who)

"""Which tokens of each sequence a rank holds, and the loader's batch split that gives them to it.

Context parallelism splits a sequence of length ``T`` into ``2n`` chunks and gives rank ``i``
chunks ``i`` and ``2n-1-i`` (*load balancing*): under a causal mask the early chunks attend to
few keys and the late ones to many, so pairing them gives every rank the same work. Ulysses
splits contiguously (``T/n`` tokens per rank): after its all-to-all every rank attends over the
whole sequence, so no balancing is needed. Positions stay global: :func:`chunk_positions` is the
global position of each local token, passed to the model as ``position_ids`` and used by the
attention's causal mask.

A transformers causal LM given ``labels`` shifts them inside its loss; on a rank's part that would pair
the last token of one chunk with the first of another. The split sees the whole batch first, so it
shifts them over the whole sequence itself (:func:`with_shift_labels`: transformers' ``shift_labels``,
as Accelerate's Ulysses loader adapter injects them) when the model was found to compute its loss
from them, and refuses ``labels`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from composable_atorch.errors import ConfigError, SequenceInputError, SequenceLossError

#: the batch keys of a transformers causal LM's own loss
LABELS, SHIFT_LABELS, NUM_ITEMS = "labels", "shift_labels", "num_items_in_batch"
#: transformers' (and torch's) ignore_index
IGNORE_INDEX = -100
#: the fix every loss refusal of a split names
SHIFT_IN_DATA = (
    "shift the targets in the data (targets[t] = inputs[t + 1], the last one ignore_index -100; TextDataset's "
    "(inputs, targets) pairs are so) and train with loss_fn=sequence_cross_entropy(model), which averages the "
    "token losses over the whole sequence"
)


def chunk_bounds(rank: int, n: int, local_len: int, balanced: bool) -> list[tuple[int, int]]:
    """The global ``[start, end)`` of each contiguous chunk rank ``rank`` of ``n`` holds, in its local order."""
    if not balanced:
        return [(rank * local_len, (rank + 1) * local_len)]
    s = local_len // 2
    return [(rank * s, (rank + 1) * s), ((2 * n - 1 - rank) * s, (2 * n - rank) * s)]


def chunk_positions(rank: int, n: int, local_len: int, balanced: bool, device=None) -> torch.Tensor:
    """The global positions of the ``local_len`` tokens rank ``rank`` of ``n`` holds (int64, 1-D)."""
    bounds = chunk_bounds(rank, n, local_len, balanced)
    return torch.cat([torch.arange(start, end, device=device) for start, end in bounds])


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


def with_shift_labels(batch: dict, n: int) -> dict:
    """``batch`` with transformers' ``shift_labels`` over the whole sequence (``labels[t + 1]``, the last
    ignored: what ``ForCausalLMLoss`` computes from ``labels``; kept when the batch has them) and
    ``num_items_in_batch`` (the counted targets, or the batch's own) divided by ``n``: each rank's loss
    is then its part's summed token losses over 1/n of the count, whose mean over the group (what the
    gradient sync takes) is the whole batch's mean."""
    shift = batch.get(SHIFT_LABELS)
    if shift is None:
        shift = F.pad(batch[LABELS][:, 1:], (0, 1), value=IGNORE_INDEX)
    items = batch.get(NUM_ITEMS)
    items = (shift != IGNORE_INDEX).sum() if items is None else torch.as_tensor(items, device=shift.device)
    return {**batch, SHIFT_LABELS: shift, NUM_ITEMS: items.float() / n}


def shard_batch(
    batch: Any, rank: int, n: int, balanced: bool, who: str, seq_len: int | None = None, labels: bool = False
) -> Any:
    """This rank's part of every ``(batch, seq, ...)`` tensor in a batch (tensors, tuples, lists, dicts).

    The sequence length is the first tensor's dimension 1; tensors of another length (per-sample
    values) are kept whole. A dict with ``labels`` gets ``shift_labels`` over the whole sequence first
    (:func:`with_shift_labels`) when ``labels`` (the model computes its loss from them), else is refused:
    the model would shift labels inside each rank's part of the sequence.
    """
    seq_len = _seq_len(batch) if seq_len is None else seq_len
    if seq_len is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return _shard(batch, rank, n, balanced, seq_len, who)
    if isinstance(batch, dict):
        if LABELS in batch:
            if not labels:
                raise SequenceLossError(
                    f"{who}: batch key 'labels'",
                    "the model would shift the labels inside each rank's part of the sequence, pairing the last "
                    "token of one chunk with the first of another; this model was not found to compute its loss "
                    "from transformers' shift_labels on a probe batch (or the probe could not run)",
                    SHIFT_IN_DATA,
                )
            batch = with_shift_labels(batch, n)
        return {k: shard_batch(v, rank, n, balanced, who, seq_len, labels) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        parts = [shard_batch(v, rank, n, balanced, who, seq_len, labels) for v in batch]
        return type(batch)(parts) if not hasattr(batch, "_fields") else type(batch)(*parts)
    return batch


def _token_tensors(batch: Any, seq_len: int) -> list[torch.Tensor]:
    """The integer ``(batch, seq_len, ...)`` tensors of a batch in order (a dict's labels left out: they are
    shifted by the split itself)."""
    if isinstance(batch, torch.Tensor):
        integer = not (batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool)
        return [batch] if integer and batch.dim() >= 2 and batch.size(1) == seq_len else []
    if isinstance(batch, dict):
        items = [v for k, v in batch.items() if k not in (LABELS, SHIFT_LABELS)]
    else:
        items = batch if isinstance(batch, list | tuple) else ()
    return [t for item in items for t in _token_tensors(item, seq_len)]


def targets_equal_inputs(batch: Any) -> bool:
    """True when a later token tensor of the batch equals its first one token for token (transformers'
    ``labels=input_ids`` habit: the loss must shift them). False for fake or meta tensors (an estimate)."""
    from torch._subclasses.fake_tensor import is_fake

    seq_len = _seq_len(batch)
    tokens = _token_tensors(batch, seq_len) if seq_len is not None else []
    if len(tokens) < 2 or any(is_fake(t) or t.is_meta for t in tokens):
        return False
    first = tokens[0]
    return any(t.shape == first.shape and t.dtype == first.dtype and torch.equal(t, first) for t in tokens[1:])


@dataclass
class DataSignals:
    """What the loader's split saw in this process's batches, for the loss guard (a worker process's
    collate has its own copy, so with ``num_workers`` > 0 nothing is seen)."""

    targets_equal_inputs: bool = False
    #: the guard has decided; the batches are no longer compared
    checking: bool = True


@dataclass
class ShardCollate:
    """The loader's collate function followed by :func:`shard_batch` (picklable, for worker processes)."""

    collate: Any
    rank: int
    n: int
    balanced: bool
    who: str
    #: the model computes its loss from ``shift_labels`` (checked before any step): a dict's ``labels``
    #: are shifted over the whole sequence, else refused
    labels: bool = False
    signals: DataSignals = field(default_factory=DataSignals)

    def __call__(self, samples):
        return self.shard(self.collate(samples))

    def shard(self, batch):
        """This rank's part of a collated batch (the estimator feeds its batch through this too)."""
        if self.signals.checking:
            self.signals.targets_equal_inputs = targets_equal_inputs(batch)
        return shard_batch(batch, self.rank, self.n, self.balanced, self.who, labels=self.labels)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three float64 numbers that tell two batches apart: the element count, the sum and a
    position-weighted sum of the values."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    count = torch.full((), float(flat.numel()), device=flat.device, dtype=torch.float64)
    return torch.stack([count, flat.sum(), (flat * weights).sum()])


def check_own_parts(tokens: torch.Tensor, group, n: int, who: str, dim: str) -> None:
    """Raise :class:`~composable_atorch.errors.SequenceInputError` when every rank of the split's
    ``group`` was given the same batch: the loader the plan returns gives each rank its own part of
    every sequence; a loop over the user's own loader (not passed to the plan) gives every rank the
    whole batch, and the split then trains on wrong positions and attention without a word (measured:
    losses 1e-3 to 1e-2 off one process's in three steps). One small all-gather, on a training
    forward whose input shape the check has not seen yet."""
    mine = _fingerprint(tokens)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    if all(torch.equal(every[0], other) for other in every[1:]):
        raise SequenceInputError(
            who,
            f"every rank of the {dim} group of {n} was given the same batch {tuple(tokens.shape)}; each must train "
            "on its own part of every sequence",
            "pass your DataLoader to the plan (model, optim, loader = plan(model, optim, loader)) and train on the "
            "loader it returns: it cuts each sequence for this rank",
        )

"""Megatron-style tensor parallelism for DeepSpeed pipeline stages: plain tensors, explicit collectives.

Why not DTensor (:mod:`.tensor`)? DeepSpeed's engine treats every parameter as a plain local tensor:
it flattens gradients into buckets and all-reduces them over its data-parallel group, its ZeRO-1
optimizer flattens the parameters themselves, its pipeline sends activations between stages with
``send``/``recv`` of plain tensors after exchanging their shapes, and its gradient clipping finds
the tensor-parallel parameters by a ``tensor_model_parallel`` attribute. A DTensor parameter or
activation would be flattened, sent or reduced as if it were whole. So, as in Megatron-LM (and
ATorch's own ATorchTPLayer), each rank keeps its shard as an ordinary ``nn.Parameter`` and the
layer says where to communicate with two autograd functions over the tensor group:

* :class:`_CopyToGroup`: identity forward, all-reduce of the gradient backward (entering a
  column-parallel layer, whose input every rank holds whole);
* :class:`_ReduceFromGroup`: all-reduce forward, identity backward (leaving a row-parallel layer
  or a vocab-parallel embedding, whose partial sums must be added).

Each layer is built from the *whole* layer (initialised identically on every tensor rank from the
same seeded stream) and keeps its slice, so a tensor-parallel run starts from exactly the weights
of the unsharded model.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

# ---------------------------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # reduced in place: never the buffer autograd handed us
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """Concatenate the ranks' last-dimension slices; backward keeps this rank's slice of the gradient
    (the loss downstream is computed identically on every tensor rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def copy_to_group(x, group):
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x, group):
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x, group):
    return _GatherFromGroup.apply(x, group)


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------


def stride_perm(n: int, stride: int, degree: int) -> torch.Tensor:
    """Order ``n`` output features so rank r's contiguous slice holds its part of each of ``stride``
    fused projections (GPT-2's qkv ``c_attn``: stride 3)."""
    part, chunk = n // stride, n // stride // degree
    return torch.tensor([s * part + r * chunk + i for r in range(degree) for s in range(stride) for i in range(chunk)])


def _mark(p: nn.Parameter) -> nn.Parameter:
    p.tensor_model_parallel = True  # DeepSpeed's clipping counts these on every tensor rank
    return p


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (out, in), bias)`` of an nn.Linear or HF's Conv1D (stored as (in, out))."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    return module.weight.detach().t(), None if module.bias is None else module.bias.detach()


class ColumnParallelLinear(nn.Module):
    """Keeps ``out_features / degree`` output rows; the output stays split (no gather)."""

    def __init__(self, whole: nn.Module, group, rank: int, degree: int, stride: int = 1):
        super().__init__()
        w, b = linear_weight(whole)
        perm = stride_perm(w.shape[0], stride, degree) if stride > 1 else None
        if perm is not None:
            w, b = w[perm], None if b is None else b[perm]
        self.group, self.degree = group, degree
        self.weight = _mark(nn.Parameter(w.chunk(degree, 0)[rank].clone(memory_format=torch.contiguous_format)))
        self.bias = (
            None
            if b is None
            else _mark(nn.Parameter(b.chunk(degree, 0)[rank].clone(memory_format=torch.contiguous_format)))
        )
        self.in_features, self.out_features = w.shape[1], w.shape[0] // degree

    def forward(self, x):
        return F.linear(copy_to_group(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Keeps ``in_features / degree`` input columns; partial outputs are summed over the group."""

    def __init__(self, whole: nn.Module, group, rank: int, degree: int, stride: int = 1):
        super().__init__()
        w, b = linear_weight(whole)
        self.group, self.degree = group, degree
        self.weight = _mark(nn.Parameter(w.chunk(degree, 1)[rank].clone(memory_format=torch.contiguous_format)))
        self.bias = (
            None if b is None else nn.Parameter(b.clone(memory_format=torch.contiguous_format))
        )  # replicated: added after the sum
        self.in_features, self.out_features = w.shape[1] // degree, w.shape[0]

    def forward(self, x):
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Keeps ``num_embeddings / degree`` rows; ids outside this rank's range look up zeros, summed over the group."""

    def __init__(self, whole: nn.Embedding, group, rank: int, degree: int, stride: int = 1):
        super().__init__()
        part = whole.num_embeddings // degree
        self.group, self.degree = group, degree
        self.start, self.end = rank * part, (rank + 1) * part
        self.num_embeddings, self.embedding_dim = part, whole.embedding_dim
        self.padding_idx = whole.padding_idx
        self.weight = _mark(
            nn.Parameter(whole.weight.detach()[self.start : self.end].clone(memory_format=torch.contiguous_format))
        )

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.group)


LAYERS = {"col": ColumnParallelLinear, "row": RowParallelLinear, "vocab": VocabParallelEmbedding}


# ---------------------------------------------------------------------------------------------
# random streams
# ---------------------------------------------------------------------------------------------


class RandomStream:
    """A CPU random stream of its own: ``with stream: ...`` draws from it and leaves the global one as it was.

    The seeds come from ``base_seed`` and the rank's coordinates: a dropout on activations every
    tensor rank holds whole (``replic_drop``) must draw the same mask on each of them, one on
    activations split over the tensor ranks (``parallel_drop``) a different one on each.
    """

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(int(seed))
        self.state = gen.get_state()
        self._fork = None

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        torch.set_rng_state(self.state)
        return self

    def __exit__(self, *exc):
        self.state = torch.get_rng_state()
        fork, self._fork = self._fork, None
        return fork.__exit__(*exc)


def with_stream(module: nn.Module, stream: RandomStream) -> None:
    """Run ``module``'s forward inside ``stream`` (set as an instance attribute: the class is untouched)."""
    forward = module.forward

    @functools.wraps(forward)  # keeps forward's signature for the pipe patcher
    def forward_in_stream(*args, **kwargs):
        with stream:
            return forward(*args, **kwargs)

    module.forward = forward_in_stream


@contextlib.contextmanager
def seeded(seed: int):
    """Build under a fixed seed without disturbing the caller's global stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield

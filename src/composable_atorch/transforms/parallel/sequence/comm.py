"""The collectives around attention, with autograd: torch's on any backend (gloo included).

* :func:`gather_sequence` (context parallelism): every rank's keys / values, concatenated in rank
  order. Its backward sums every rank's gradient for the gathered tensor and keeps this rank's part
  (an all-reduce then a slice: twice a reduce-scatter's traffic, but exact on every backend).
* :func:`sequence_to_heads` / :func:`heads_to_sequence` (Ulysses): an all-to-all from
  ``(batch, heads, seq/n, dim)`` to ``(batch, heads/n, seq, dim)`` and back. Each is a permutation
  of the data across ranks, so each one's backward is the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n, dim):
        ctx.group, ctx.n, ctx.dim = group, n, dim
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        mine = grad.chunk(ctx.n, dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None, None


def gather_sequence(x: torch.Tensor, group, n: int, dim: int = 2) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; gradients flow back to their owners."""
    return _GatherSequence.apply(x, group, n, dim)


def _to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    b, h, length, d = x.shape
    send = x.reshape(b, n, h // n, length, d).transpose(0, 1).contiguous()  # [j] = head group j -> rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [j] = rank j's tokens of this rank's head group
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, d)


def _to_sequence(y: torch.Tensor, group, n: int) -> torch.Tensor:
    b, h, total, d = y.shape
    send = y.reshape(b, h, n, total // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [j] = tokens of rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [j] = head group j for this rank's tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * h, total // n, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _to_heads(x, group, n)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad, ctx.group, ctx.n), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, n):
        ctx.group, ctx.n = group, n
        return _to_sequence(y, group, n)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.group, ctx.n), None, None


def sequence_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """``(b, h, s/n, d)`` on each rank -> ``(b, h/n, s, d)``: the whole sequence for this rank's heads."""
    return _SequenceToHeads.apply(x, group, n)


def heads_to_sequence(y: torch.Tensor, group, n: int) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`."""
    return _HeadsToSequence.apply(y, group, n)

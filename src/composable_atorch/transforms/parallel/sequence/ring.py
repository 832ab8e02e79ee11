"""Ring attention for context parallelism: keys and values travel around the context group.

Each rank keeps its queries and passes its key/value block to the next rank ``n - 1`` times
(``batch_isend_irecv``, started before the block in hand is computed, so the transfer overlaps
the compute on a device that can overlap). Partial attentions are merged with their
log-sum-exps (online softmax), which gives exactly the softmax over all keys. The causal mask
is over global positions (the load-balanced chunks of :mod:`.shard`: every block holds keys some of
this rank's queries see, so none is skipped, and no step depends on the data: the estimator's
fake tensors run it).

The backward is written out (flash-attention's): it recomputes each block's probabilities from
the saved log-sum-exp, accumulates the query gradient locally, and sends each block's key/value
gradient around the ring with the block, one more step, back to its owner. Nothing of size
``n x local`` is kept for the backward (the all-gather rotation keeps the gathered keys and values
and the ``(local, whole)`` scores): per-rank memory is that of the rank's own part.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from composable_atorch.transforms.parallel.sequence.shard import chunk_positions


def _shift(tensors: list[torch.Tensor], group, rank: int, n: int) -> tuple[list[torch.Tensor], list]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's."""
    recv = [torch.empty_like(t) for t in tensors]
    ops = []
    for t, r in zip(tensors, recv, strict=True):
        ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % n))
        ops.append(dist.P2POp(dist.irecv, r, group=group, group_peer=(rank - 1) % n))
    return recv, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _mask(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None) -> torch.Tensor | None:
    return None if q_pos is None else q_pos[:, None] >= k_pos[None, :]


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, n, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        length = q.size(2)
        q_pos = chunk_positions(rank, n, length, True, q.device) if causal else None
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv, works = [k, v], []
        for step in range(n):
            if step < n - 1:
                nxt, works = _shift(kv, group, rank, n)
            src = (rank - step) % n
            k_pos = chunk_positions(src, n, length, True, q.device) if causal else None
            mask = _mask(q_pos, k_pos)
            if True:  # with load-balanced chunks no block lies wholly in the future of this rank's queries
                s = _scores(q.float(), kv[0].float(), scale, mask)
                blk = torch.logsumexp(s, dim=-1)
                safe = torch.where(torch.isinf(blk), torch.zeros_like(blk), blk)
                out = torch.matmul(torch.exp(s - safe[..., None]), kv[1].float())
                new = torch.logaddexp(lse, blk)
                new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
                acc = acc * torch.exp(lse - new_safe)[..., None] + out * torch.exp(blk - new_safe)[..., None]
                lse = new
            if step < n - 1:
                _wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.group, ctx.rank, ctx.n, ctx.causal, ctx.scale = group, rank, n, causal, scale
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, n, scale = ctx.group, ctx.rank, ctx.n, ctx.scale
        length = q.size(2)
        dout = grad.float()
        delta = (dout * out).sum(-1, keepdim=True)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
        q_pos = chunk_positions(rank, n, length, True, q.device) if ctx.causal else None
        qf = q.float()
        dq = torch.zeros_like(qf)
        # the block in hand travels with its key/value gradient accumulated so far
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(n):
            if step < n - 1:
                nxt_kv, kv_works = _shift(kv, group, rank, n)
            src = (rank - step) % n
            k_pos = chunk_positions(src, n, length, True, q.device) if ctx.causal else None
            mask = _mask(q_pos, k_pos)
            if True:
                kf, vf = kv[0].float(), kv[1].float()
                p = torch.exp(_scores(qf, kf, scale, mask) - safe_lse)
                dkv[1] = dkv[1] + torch.matmul(p.transpose(-2, -1), dout)
                ds = p * (torch.matmul(dout, vf.transpose(-2, -1)) - delta)
                dq = dq + torch.matmul(ds, kf) * scale
                dkv[0] = dkv[0] + torch.matmul(ds.transpose(-2, -1), qf) * scale
            # every block's gradient moves on with it; after n moves it is back at its owner
            dkv_next, dkv_works = _shift(dkv, group, rank, n)
            _wait(dkv_works)
            dkv = dkv_next
            if step < n - 1:
                _wait(kv_works)
                kv = nxt_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, group, rank: int, n: int, *, causal: bool, scale: float | None = None) -> torch.Tensor:
    """``q, k, v``: ``(batch, heads, local, dim)`` with the same heads -> this rank's attention output.

    The same as ``scaled_dot_product_attention`` over the whole sequence (causal over the global
    positions of the load-balanced chunks) for this rank's queries.
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, rank, n, causal, scale)

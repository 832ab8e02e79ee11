"""Ring attention for context parallelism: keys and values travel around the context group.

Each rank keeps its queries and passes its key/value block to the next rank ``n - 1`` times
(``batch_isend_irecv``, started before the block in hand is computed, so the transfer overlaps
the compute on a device that can overlap). Partial attentions are merged with their
log-sum-exps (online softmax), which gives exactly the softmax over all keys. The causal mask
is over global positions (the load-balanced chunks of :mod:`.shard`: every block holds keys some of
this rank's queries see, so none is skipped, and no step depends on the data: the estimator's
fake tensors run it).

Each block runs torch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``:
output and log-sum-exp, no scores held; plain matmuls on other devices). The backward is written
out (flash-attention's): the kernel's backward for each block from the whole attention's output and
log-sum-exp, the query gradient accumulated locally, each block's key/value gradient sent around
the ring with the block, one more step, back to its owner. Nothing of size ``n x local`` is kept
for the backward (the all-gather rotation keeps the gathered keys and values).
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


def _mask(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, causal: bool = True, window=None):
    """Which keys each query sees, over global positions: causal and / or within a sliding window
    (transformers' ``sliding_window_overlay``: ``q - k < window``; ``|q - k| < window`` when not causal)."""
    if q_pos is None:
        return None
    d = q_pos[:, None] - k_pos[None, :]
    mask = d >= 0 if causal else torch.ones(d.shape, dtype=torch.bool, device=d.device)
    if window is not None:
        mask = mask & ((d < window) if causal else (d.abs() < window))
    return mask


def _flash(q: torch.Tensor) -> bool:
    """torch's CPU flash-attention kernel (it returns the log-sum-exp and takes it back in its
    backward, and never holds a block's scores); elsewhere the blocks are plain matmuls."""
    return q.device.type == "cpu"


def _block_forward(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out fp32, lse fp32)`` of ``q`` over one key/value block; rows that see none of it: lse -inf."""
    if _flash(q):
        add = (
            None
            if mask is None
            else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        )
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=add, scale=scale
        )
        if mask is not None:  # the kernel gives a row that sees nothing lse 0 and output 0
            lse = torch.where(mask.any(-1), lse.float(), float("-inf"))
        return out.float(), lse.float()
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(s - safe[..., None]), v.float()), lse


def _block_backward(dout, q, k, v, out, lse, mask, scale) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` fp32 of one block's share, from the whole attention's ``out`` and ``lse``."""
    if _flash(q):
        add = (
            None
            if mask is None
            else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        )
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, False, attn_mask=add, scale=scale
        )
        return tuple(g.float() for g in grads)
    qf, kf, vf, dout = q.float(), k.float(), v.float(), dout.float()
    s = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    ds = p * (torch.matmul(dout, vf.transpose(-2, -1)) - (dout * out).sum(-1, keepdim=True))
    return (
        torch.matmul(ds, kf) * scale,
        torch.matmul(ds.transpose(-2, -1), qf) * scale,
        torch.matmul(p.transpose(-2, -1), dout),
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, n, causal, scale, window):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        length = q.size(2)
        positioned = causal or window is not None
        q_pos = chunk_positions(rank, n, length, True, q.device) if positioned else None
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv, works = [k, v], []
        # with load-balanced chunks every block holds keys some of this rank's queries see: none is
        # skipped, and no step depends on the data (the estimator's fake tensors run it)
        for step in range(n):
            if step < n - 1:
                nxt, works = _shift(kv, group, rank, n)
            src = (rank - step) % n
            k_pos = chunk_positions(src, n, length, True, q.device) if positioned else None
            mask = _mask(q_pos, k_pos, causal, window)
            out, blk = _block_forward(q, kv[0], kv[1], mask, scale)
            new = torch.logaddexp(lse, blk)
            new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
            acc = acc * torch.exp(lse - new_safe)[..., None] + out * torch.exp(blk - new_safe)[..., None]
            lse = new
            if step < n - 1:
                _wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.group, ctx.rank, ctx.n, ctx.causal, ctx.scale, ctx.window = group, rank, n, causal, scale, window
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, n, scale = ctx.group, ctx.rank, ctx.n, ctx.scale
        length = q.size(2)
        positioned = ctx.causal or ctx.window is not None
        q_pos = chunk_positions(rank, n, length, True, q.device) if positioned else None
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # the block in hand travels with its key/value gradient accumulated so far
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(n):
            if step < n - 1:
                nxt_kv, kv_works = _shift(kv, group, rank, n)
            src = (rank - step) % n
            k_pos = chunk_positions(src, n, length, True, q.device) if positioned else None
            mask = _mask(q_pos, k_pos, ctx.causal, ctx.window)
            dq_b, dk_b, dv_b = _block_backward(grad, q, kv[0], kv[1], out, lse, mask, scale)
            dq = dq + dq_b
            dkv = [dkv[0] + dk_b, dkv[1] + dv_b]
            # every block's gradient moves on with it; after n moves it is back at its owner
            dkv_next, dkv_works = _shift(dkv, group, rank, n)
            _wait(dkv_works)
            dkv = dkv_next
            if step < n - 1:
                _wait(kv_works)
                kv = nxt_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(
    q, k, v, group, rank: int, n: int, *, causal: bool, scale: float | None = None, window: int | None = None
) -> torch.Tensor:
    """``q, k, v``: ``(batch, heads, local, dim)`` with the same heads -> this rank's attention output.

    The same as ``scaled_dot_product_attention`` over the whole sequence (causal and / or within a
    sliding ``window``, over the global positions of the load-balanced chunks) for this rank's queries.
    A block some of whose queries see none of its keys (a window) gives them log-sum-exp -inf.
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, rank, n, causal, scale, window)

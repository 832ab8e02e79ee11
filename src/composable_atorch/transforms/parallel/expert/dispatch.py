"""Token dispatch for expert parallelism: all-to-all to the experts' ranks and back.

Each rank of an expert group of ``n`` holds experts ``[r * E/n, (r+1) * E/n)`` of every MoE
layer. :func:`dispatch_forward` replaces an experts module's forward: the (token, slot) pairs the
router chose are sorted by expert, sent to the rank holding that expert (one all-to-all of the
hidden states, one of the local expert ids), run there through the module's *own* forward over
its local experts (so each family's activation, biases and gate layout are its own code, not a
copy), sent back (a second all-to-all) and combined with the routing weights on the source rank.
No token is dropped (no capacity factor): the split sizes are exchanged each step.

The all-to-all's backward is the reverse all-to-all, so expert weights receive the gradient of
every token routed to them from any rank of the group: the sum of ``n`` ranks' loss gradients,
where one process's mean over the global batch wants their mean. The gradient entering the local
experts is therefore scaled by ``1/n`` and the one leaving them towards the tokens by ``n``
(:class:`_ScaleGrad`), so the experts' gradient is the expert group's mean and the tokens' is
untouched; the data-parallel step then only averages experts over their data replicas, as any
replicated parameter (see ``transform``). Exact for a power-of-two degree.

On fake tensors (``estimate``'s simulated step) the router's choices have no values: the split sizes
are those of a balanced router (:func:`balanced_splits`), so the simulated exchange buffers and local
expert activations are the balanced ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, send_splits, recv_splits, group)


def _exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def dispatch_forward(module, local_forward, hidden_states, top_k_index, top_k_weights):
    """The expert-parallel forward of an experts module (``module.expert_parallel`` holds its group).

    ``local_forward(module, x, idx, w)`` is the module class's own forward, run on the tokens this
    rank received with their local expert ids (``idx`` of shape [n, 1]) and unit weights.
    """
    info = module.expert_parallel
    degree, per_rank, group = info.degree, info.per_rank, info.group
    tokens, k = top_k_index.shape
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    source_token = torch.div(order, k, rounding_mode="floor")
    dest = torch.div(sorted_expert, per_rank, rounding_mode="floor")
    if _is_fake(top_k_index):  # estimate's simulated step: no router values, no exchanged counts
        send_splits = recv_splits = balanced_splits(tokens * k, degree)
    else:
        send = torch.bincount(dest, minlength=degree)
        recv = _exchange_counts(send, group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
    x = hidden_states.reshape(tokens, -1)
    received = all_to_all(x[source_token], send_splits, recv_splits, group)
    local_ids = _exchange_ids(sorted_expert - dest * per_rank, send_splits, recv_splits, group)
    ones = torch.ones(local_ids.shape[0], 1, dtype=top_k_weights.dtype, device=received.device)
    # expert gradients: the mean over the expert group's ranks; token gradients unchanged (module docstring)
    out = local_forward(module, _ScaleGrad.apply(received, float(degree)), local_ids.unsqueeze(1), ones)
    if torch.is_grad_enabled():
        # every rank must run both backward all-to-alls, and every local expert must get a gradient
        # (zeros), even where no token came or a family's forward skips experts with no token
        out = out + _zero_link(received, module)
    out = _ScaleGrad.apply(out, 1.0 / degree)
    back = all_to_all(out, recv_splits, send_splits, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
    combined = torch.zeros_like(x, dtype=hidden_states.dtype)
    return combined.index_add(0, source_token, (back * weights).to(hidden_states.dtype))


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def balanced_splits(slots: int, degree: int) -> list[int]:
    """``slots`` (token, expert) pairs spread evenly over ``degree`` ranks: what a balanced router
    sends each rank, and receives from each. ``estimate`` simulates the dispatch with these sizes (a
    fake process group exchanges no values); a real router's imbalance moves only the exchange buffers
    and the local experts' activations, not the weights, gradients or optimizer state."""
    return [slots // degree + (1 if r < slots % degree else 0) for r in range(degree)]


def _zero_link(received: torch.Tensor, module) -> torch.Tensor:
    """A zero scalar whose graph reaches ``received`` and every trainable parameter of ``module``."""
    link = received.reshape(-1)[:0].sum()
    for p in module.parameters():
        if p.requires_grad:
            link = link + p.reshape(-1)[:0].sum()
    return link


def _exchange_ids(ids: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    out = ids.new_empty(sum(recv_splits))
    dist.all_to_all_single(out, ids.contiguous(), recv_splits, send_splits, group=group)
    return out

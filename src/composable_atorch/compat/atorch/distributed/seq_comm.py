"""ATorch's ``seq_all_to_all(input, scatter_idx, gather_idx, group, group_size)``.

An ATorch model's ``set_sp`` calls it around attention: each rank splits ``input`` into
``group_size`` pieces along ``scatter_idx``, sends piece ``j`` to rank ``j`` of ``group`` and
concatenates what it receives along ``gather_idx`` (rank order). Its backward is the same exchange
with the two dimensions swapped, so gradients return to the ranks that sent the activations.
Written over torch's ``all_to_all_single`` (gloo included); the library's own Ulysses uses
:mod:`composable_atorch.transforms.parallel.sequence.comm` and does not need this.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, scatter_idx: int, gather_idx: int, group, n: int) -> torch.Tensor:
    if x.size(scatter_idx) % n:
        from composable_atorch.errors import ConfigError

        raise ConfigError(
            "seq_all_to_all input", tuple(x.shape), f"a size along dim {scatter_idx} divisible by group_size {n}"
        )
    send = torch.stack(x.chunk(n, dim=scatter_idx)).contiguous()  # [j] goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [j] came from rank j
    return torch.cat(recv.unbind(0), dim=gather_idx)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_idx, gather_idx, group, n):
        ctx.args = scatter_idx, gather_idx, group, n
        return _exchange(x, scatter_idx, gather_idx, group, n)

    @staticmethod
    def backward(ctx, grad):
        scatter_idx, gather_idx, group, n = ctx.args
        return _exchange(grad, gather_idx, scatter_idx, group, n), None, None, None, None


def seq_all_to_all(input, scatter_idx, gather_idx, group=None, group_size=None):  # noqa: A002 - ATorch's name
    """ATorch's signature; ``group_size`` defaults to the group's size."""
    n = group_size if group_size is not None else dist.get_world_size(group)
    if n == 1:
        return input
    return _SeqAllToAll.apply(input, scatter_idx, gather_idx, group, n)

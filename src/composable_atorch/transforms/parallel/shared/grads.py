"""A plan's gradients judged whole, over every rank that holds a part of them: their norm (for
clipping) and whether they are all finite (for skipping a step).

Where the parts are:

- DTensor gradients (FSDP2's shards, tensor-parallel weights) know their own mesh: torch makes
  their norm full, and their inf/nan verdict is reduced over each dimension of that mesh;
- plain gradients are replicated over the data dimensions (the same on every replica, counted once);
- a pipeline's stages hold different parameters (:class:`~composable_atorch.runtime.mesh.StageGradients`):
  each rank's part is summed over the pipeline group, a parameter several stages hold in full
  (tied embeddings, pieces every stage uses) weighted so it counts once;
- fairscale's OSS shards outside DTensor (``grad_shard_group``): the verdict is reduced over it (its
  optimizer clips with its own ``clip_grad_norm``).

One process computes ``vector_norm`` of every gradient's norm; here the norms of each kind are
combined the same way, so a plan's norm equals one process's up to float association.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["all_finite", "clip_grads_", "grad_norm"]


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor")


def _norm(grads: list, p: float) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, p)
    return (norm.full_tensor() if _is_dtensor(norm) else norm).float()


def grad_norm(params, norm_type: float = 2.0, parallel=None) -> torch.Tensor:
    """The norm of the gradients of ``params`` over the whole model, as a plain float32 tensor.

    ``parallel``: the plan's ParallelContext (its pipeline split, if any, is reduced over: every
    rank of the pipeline must call this, with or without gradients of its own)."""
    p = float(norm_type)
    split = getattr(parallel, "stage_grads", None)
    held = split.held_by if split is not None else {}
    seen, by_weight = set(), {}
    for param in params:
        if param.grad is None or id(param) in seen:
            continue
        seen.add(id(param))
        kind = _is_dtensor(param.grad)
        by_weight.setdefault((1.0 / held.get(id(param), 1), kind), []).append(param.grad)
    parts = [(_norm(grads, p), weight) for (weight, _), grads in by_weight.items()]
    mesh = getattr(parallel, "mesh", None)  # a rank without gradients still joins, on the mesh's device
    device = parts[0][0].device if parts else torch.device(getattr(mesh, "device_type", "cpu"))
    if math.isinf(p):
        total = torch.stack([n for n, _ in parts]).max() if parts else torch.zeros((), device=device)
        if split is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=split.group)
        return total
    total = sum((w * n.pow(p) for n, w in parts), torch.zeros((), device=device))
    if split is not None:
        dist.all_reduce(total, group=split.group)
    return total.pow(1.0 / p)


def clip_grads_(params, max_norm: float, norm_type: float = 2.0, parallel=None) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over the whole model's gradients (see :func:`grad_norm`); returns
    the norm before clipping. The coefficient stays a tensor, as torch's: no device sync, and a
    simulated step on fake tensors runs it too. DTensor and plain gradients are scaled apart (torch's
    foreach ops refuse the two kinds mixed in one list)."""
    params = list(params)
    total = grad_norm(params, norm_type, parallel)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    kinds: dict[tuple, list] = {}
    for param in params:
        if param.grad is not None:
            kinds.setdefault((_is_dtensor(param.grad), param.grad.device), []).append(param.grad)
    with torch.no_grad():
        for (_, where), grads in kinds.items():
            torch._foreach_mul_(grads, coef.to(where))
    return total


def _local_nonfinite(local: list, fake_type) -> torch.Tensor:
    """1.0 when a gradient of this rank holds inf/nan, else 0.0 (a tensor, to reduce over groups).

    One sum per gradient, then an exact per-element check only when the total is not finite: an
    inf or nan in any gradient always makes the sum inf or nan, and a sum can only overflow (a false
    alarm the exact check clears) when the gradients are beyond 1e38. Why not ``isfinite`` per
    gradient or an inf-norm: each makes a full pass plus a bool tensor, measured at ~12 ms for a
    5M-parameter model on one CPU thread against ~1 ms for the sums (~6% of a bf16 DDP step).
    """
    if not local:
        return torch.zeros(())
    total = torch.stack([g.sum(dtype=torch.float32) for g in local]).sum()
    finite = torch.isfinite(total)
    if isinstance(total, fake_type) or bool(finite):  # a simulated step has no values to look at
        return (~finite).float()
    return torch.stack([~torch.isfinite(g).all() for g in local]).any().float()


def all_finite(grads, parallel=None) -> bool:
    """True when every gradient is finite on every rank holding a part of the model's gradients.

    Local parts are checked here and the verdict reduced over their groups (each DTensor mesh's
    dimensions, fairscale's shard group, a pipeline's group), so all ranks skip the same steps."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    bad = _local_nonfinite(local, FakeTensor)
    groups = {id(g.device_mesh): g.device_mesh for g in grads if isinstance(g, DTensor)}
    for mesh in groups.values():
        for dim in range(mesh.ndim):
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    split = getattr(parallel, "stage_grads", None)
    for group in (getattr(parallel, "grad_shard_group", None), split.group if split is not None else None):
        if group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if isinstance(bad, FakeTensor):  # a simulated step (estimate): values are unknown, the step goes ahead
        return True
    return not bool(bad)

"""Checkpoints of expert-parallel models: each rank's experts written as its shard of the whole.

An expert rank holds experts ``[r * E/n, (r+1) * E/n)`` under the full name, as a plain tensor of
``E/n`` rows. DCP would read that as one replicated tensor (saving one rank's experts as all of
them), so ``save_state`` hands it a DTensor view instead: the local rows as ``Shard(0)`` of the
``[E, ...]`` whole over the expert mesh (the data replicas write the same chunk, which DCP keeps
once). ``load_state`` builds the same views at the *loading* run's expert degree, so DCP reads each
rank's rows of the whole, whatever degree saved it (a model without expert parallelism reads the
whole tensor), then hands the plain rows back. The optimizer's per-parameter state (AdamW's
moments) travels the same way.

Experts sharded by fsdp as well (DTensors over the data mesh) are not handled here:
:func:`unsupported` names them so save_state / load_state refuse before any work.
"""

from __future__ import annotations

import torch
from torch import nn

from composable_atorch.transforms.parallel.expert.transform import SHARD_ATTR, ExpertShard


def _split(model: nn.Module) -> dict[str, ExpertShard]:
    """``{parameter name: its module's ExpertShard}`` for every split expert parameter."""
    out = {}
    for mname, m in model.named_modules():
        shard = getattr(m, SHARD_ATTR, None)
        if isinstance(shard, ExpertShard):
            for pname, _ in m.named_parameters():
                out[f"{mname}.{pname}" if mname else pname] = shard
    return out


def unsupported(model: nn.Module) -> list[str]:
    """Split expert parameters that are also DTensors (fsdp over the data dimension): not checkpointed here."""
    params = dict(model.named_parameters())
    return [n for n in _split(model) if n in params and hasattr(params[n], "placements")]


def _global(t: torch.Tensor, shard: ExpertShard, fresh: bool = False):
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.dim() == 0 or t.shape[0] != shard.per_rank:
        return t
    t = torch.empty_like(t) if fresh else t
    shape = torch.Size((shard.total, *t.shape[1:]))
    return DTensor.from_local(t, shard.mesh, [Shard(0)], run_check=False, shape=shape, stride=_contiguous(shape))


def _contiguous(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _convert(model: nn.Module, model_sd, optim_sd, one) -> None:
    """Apply ``one(tensor, shard)`` to the split experts' entries of a model state dict and of an
    optimizer state dict, nested (``state[fqn][key]``) or flattened as save_state writes it
    (``"state.{fqn}.{key}"``)."""
    split = _split(model)
    if not split:
        return
    for name, shard in split.items():
        if model_sd is not None and name in model_sd:
            model_sd[name] = one(model_sd[name], shard)
        if not optim_sd:
            continue
        nested = optim_sd.get("state")
        if isinstance(nested, dict) and name in nested:
            nested[name] = {k: one(v, shard) for k, v in nested[name].items()}
        prefix = f"state.{name}."
        for key in [k for k in optim_sd if isinstance(k, str) and k.startswith(prefix)]:
            optim_sd[key] = one(optim_sd[key], shard)


def to_global(model: nn.Module, model_sd: dict | None = None, optim_sd: dict | None = None, fresh=False) -> None:
    """Replace (in place) the split experts' entries of a model / optimizer state dict by global views
    (``fresh``: of new uninitialised tensors, for DCP to fill without touching the live ones)."""
    _convert(model, model_sd, optim_sd, lambda t, shard: _global(t, shard, fresh))


def to_local(model: nn.Module, model_sd: dict | None = None, optim_sd: dict | None = None) -> None:
    """Undo :func:`to_global` (in place): the rows this rank holds, as plain tensors."""
    _convert(model, model_sd, optim_sd, lambda t, shard: _local(t))

"""Checkpoints of expert-parallel models: each rank's experts written as its shard of the whole.

An expert rank holds experts ``[r * E/n, (r+1) * E/n)`` under the full name, as ``E/n`` rows. DCP
would read that as the whole tensor (saving one rank's experts as all of them), so ``save_state``
hands it a DTensor view instead: the local rows as ``Shard(0)`` of the ``[E, ...]`` whole over the
expert mesh. ``load_state`` builds the same views at the *loading* run's expert degree, so DCP reads
each rank's rows of the whole, whatever degree saved it (a model without expert parallelism reads the
whole tensor, as any other parameter), then hands the rows back in the live parameter's form. The
optimizer's per-parameter state (AdamW's moments) travels the same way.

Experts sharded by fsdp as well (ATorch's ``expert_fsdp``: a DTensor of the ``E/n`` rows over the
data mesh, placements ``P``) are viewed over the 2-D ``(expert, *data dims)`` mesh with placements
``[Shard(0), *P]``: DTensor splits the rows by expert first, then each expert rank's rows as fsdp
did, which is where this rank's local rows sit in the whole. That mesh is built from the root
mesh's rank layout without process groups (nothing here communicates; DCP only reads each chunk's
offset from it). The data replicas of a ddp layout write the same chunk, which DCP keeps once.

What cannot be viewed so (a data mesh whose dimensions are not named in the plan's device mesh, a
placement other than Shard / Replicate) is named by :func:`unsupported`, and save_state /
load_state refuse before any work.
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


def _why_not(shard: ExpertShard, p) -> str | None:
    """Why a split expert parameter cannot be written as its shard of the whole (None: it can)."""
    from torch.distributed.tensor import Replicate, Shard

    if not hasattr(p, "placements"):
        return None if shard.mesh is not None else "no expert mesh"
    names = p.device_mesh.mesh_dim_names or ()
    root = shard.mesh._get_root_mesh().mesh_dim_names or ()
    if not names or any(n not in root for n in names):
        return f"its fsdp mesh {names or '(unnamed)'} is not made of the plan's mesh dimensions {root}"
    odd = [type(pl).__name__ for pl in p.placements if type(pl) not in (Shard, Replicate)]
    if odd:
        return f"its placements {odd} are neither Shard nor Replicate"
    return None


def unsupported(model: nn.Module) -> list[str]:
    """``"name (why)"`` for every split expert parameter a checkpoint cannot place in the whole."""
    params = dict(model.named_parameters())
    out = []
    for name, shard in _split(model).items():
        why = _why_not(shard, params[name]) if name in params else None
        if why:
            out.append(f"{name} ({why})")
    return out


_MESHES: dict = {}


def _expert_mesh(shard: ExpertShard, inner):
    """The ``(expert, *inner's dims)`` mesh holding this rank, built from the root mesh's rank layout
    without process groups (made once per pair of meshes)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(shard.mesh), id(inner))
    if key in _MESHES:
        return _MESHES[key][2]
    root = shard.mesh._get_root_mesh()
    names = root.mesh_dim_names
    dims = (shard.mesh.mesh_dim_names[0], *inner.mesh_dim_names)
    coordinate = root.get_coordinate()
    index = tuple(slice(None) if n in dims else coordinate[i] for i, n in enumerate(names))
    kept = [n for n in names if n in dims]
    ranks = root.mesh[index].permute([kept.index(d) for d in dims])
    mesh = DeviceMesh(root.device_type, ranks, mesh_dim_names=dims, _init_backend=False)
    _MESHES[key] = (shard.mesh, inner, mesh)  # the meshes kept alive: their ids stay theirs
    return mesh


def _global(t: torch.Tensor, shard: ExpertShard, fresh: bool = False):
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != shard.per_rank:
        return t
    local = t.to_local() if isinstance(t, DTensor) else t
    local = torch.empty_like(local) if fresh else local
    shape = torch.Size((shard.total, *t.shape[1:]))
    if isinstance(t, DTensor):  # fsdp-sharded experts: expert first, then fsdp's own split
        mesh, placements = _expert_mesh(shard, t.device_mesh), [Shard(0), *t.placements]
    else:
        mesh, placements = shard.mesh, [Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=_contiguous(shape))


def _contiguous(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _local(t, param):
    """The rows this rank holds, in the live parameter's form (a DTensor over fsdp's mesh, or plain)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor) or (isinstance(param, DTensor) and t.device_mesh is param.device_mesh):
        return t
    local = t.to_local()
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


def _convert(model: nn.Module, model_sd, optim_sd, one) -> None:
    """Apply ``one(tensor, shard, parameter)`` to the split experts' entries of a model state dict and of
    an optimizer state dict, nested (``state[fqn][key]``) or flattened as save_state writes it
    (``"state.{fqn}.{key}"``)."""
    split = _split(model)
    if not split:
        return
    params = dict(model.named_parameters())
    for name, shard in split.items():
        p = params.get(name)
        if model_sd is not None and name in model_sd:
            model_sd[name] = one(model_sd[name], shard, p)
        if not optim_sd:
            continue
        nested = optim_sd.get("state")
        if isinstance(nested, dict) and name in nested:
            nested[name] = {k: one(v, shard, p) for k, v in nested[name].items()}
        prefix = f"state.{name}."
        for key in [k for k in optim_sd if isinstance(k, str) and k.startswith(prefix)]:
            optim_sd[key] = one(optim_sd[key], shard, p)


def to_global(model: nn.Module, model_sd: dict | None = None, optim_sd: dict | None = None, fresh=False) -> None:
    """Replace (in place) the split experts' entries of a model / optimizer state dict by global views
    (``fresh``: of new uninitialised tensors, for DCP to fill without touching the live ones)."""
    _convert(model, model_sd, optim_sd, lambda t, shard, p: _global(t, shard, fresh))


def to_local(model: nn.Module, model_sd: dict | None = None, optim_sd: dict | None = None) -> None:
    """Undo :func:`to_global` (in place): the rows this rank holds, as the live parameter holds them."""
    _convert(model, model_sd, optim_sd, lambda t, shard, p: _local(t, p))


def gather_whole(model: nn.Module, state: dict) -> None:
    """Replace (in place) the split experts' entries of a full model state dict (keys as the model names
    its parameters) by the whole ``[E, ...]`` tensors, on CPU: each expert rank's rows (fsdp's shards
    joined first), all-gathered over the expert group. Collective, every rank in the same order; a rank
    whose state dict lacks the name (not rank 0 of a gather to rank 0) drops the result."""
    import torch.distributed as dist

    params = dict(model.named_parameters())
    for name, shard in _split(model).items():
        p = params.get(name)
        if p is None:
            continue
        rows = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().contiguous()
        whole = rows.new_empty((shard.total, *rows.shape[1:]))
        dist.all_gather_into_tensor(whole, rows, group=shard.group)
        if name in state:
            state[name] = whole.cpu()

"""Checkpoints of fused (strided) tensor-parallel layers in the user's own layout.

A fused projection such as GPT-2's qkv ``c_attn`` (``TPInfo`` ``{"stride": 3}``) is sharded so
that each rank holds its slice of each of the ``stride`` parts: before sharding the output
features are permuted (``_tp_stride_perm``) so a contiguous ``Shard`` gives rank r
``[q_r, k_r, v_r]``. Saved as it is, DCP would store that permuted tensor, and a one-process
model (or another degree) would load q, k and v scrambled. So :func:`save_layout` presents each
strided parameter — and every optimizer state of its shape — to DCP as a DTensor of the
*unpermuted* tensor with the same placements, and :func:`load_layout` loads into such a template
and permutes back into the live shards. Each costs one all-gather of that layer (one layer at a
time), only for strided layers; everything else goes to DCP untouched. (DTensor's
``_StridedShard`` describes this layout but DCP stores one contiguous chunk per rank, which a
strided shard is not.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def strided_params(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Canonical parameter name -> (permuted dim, permutation) for every strided TP parameter."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    from composable_atorch.transforms.parallel.tensor.planner import is_conv1d

    out: dict[str, tuple[int, torch.Tensor]] = {}
    for mod_name, m in model.named_modules():
        perm = getattr(m, "_tp_stride_perm", None)
        if perm is None:
            continue
        for attr in ("weight", "bias"):
            if getattr(m, attr, None) is None:
                continue
            dim = 1 if attr == "weight" and is_conv1d(m) else 0
            for fqn in _get_fqns(model, f"{mod_name}.{attr}" if mod_name else attr):
                out[fqn] = (dim, perm)
    return out


def _targets(state: dict, strided: dict) -> list[tuple[str, str, int, torch.Tensor]]:
    """(section, key, dim, perm) of every DTensor in the state that holds a strided parameter's layout."""
    found = []
    for section, sd in state.items():
        if section not in ("model", "optim"):
            continue
        for key, value in sd.items():
            if not hasattr(value, "full_tensor"):
                continue
            fqn = key if section == "model" else _optim_fqn(key, strided)
            if fqn in strided:
                dim, perm = strided[fqn]
                if value.dim() > dim and value.shape[dim] == perm.numel():
                    found.append((section, key, dim, perm))
    return found


def _optim_fqn(key: str, strided: dict) -> str | None:
    """``state.<fqn>.<name>`` (flattened optimizer state) -> ``<fqn>`` when it names a strided parameter."""
    if not key.startswith("state."):
        return None
    body = key[len("state.") :]
    fqn = body.rpartition(".")[0]
    return fqn if fqn in strided else None


def _like(value, full: torch.Tensor):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, value.device_mesh, value.placements)


def save_layout(model: nn.Module, state: dict) -> dict:
    """The state with strided layers' DTensors replaced by DTensors of the unpermuted tensors."""
    strided = strided_params(model)
    if not strided:
        return state
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
    for section, key, dim, perm in _targets(state, strided):
        value = state[section][key]
        out[section][key] = _like(value, value.full_tensor().index_select(dim, torch.argsort(perm)))
    return out


def load_layout(model: nn.Module, state: dict) -> tuple[dict, Callable[[], None]]:
    """(the state DCP loads into, a function to call after the load that fills the live shards)."""
    from torch.distributed.tensor import DTensor

    strided = strided_params(model)
    if not strided:
        return state, lambda: None
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
    pending = []
    for section, key, dim, perm in _targets(state, strided):
        value = state[section][key]
        template = DTensor.from_local(
            torch.empty_like(value.to_local()),
            value.device_mesh,
            value.placements,
            shape=value.shape,
            stride=value.stride(),
            run_check=False,
        )
        out[section][key] = template
        pending.append((value, template, dim, perm))
    replaced = {(section, key) for section, key, _, _ in _targets(state, strided)}

    def finish():
        # DCP assigns non-tensor entries (hyperparameters, bytes) into the dict it was given: copy them back
        for section, sd in out.items():
            if isinstance(sd, dict) and isinstance(state.get(section), dict):
                state[section].update({k: v for k, v in sd.items() if (section, k) not in replaced})
        with torch.no_grad():
            for value, template, dim, perm in pending:
                value.to_local().copy_(_like(value, template.full_tensor().index_select(dim, perm)).to_local())

    return out, finish

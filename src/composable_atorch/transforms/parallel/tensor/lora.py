"""LoRA-wrapped projections (peft's ``lora.Linear``) under tensor parallelism.

A wrapper computes ``base(x) + B(A(dropout(x))) * scale`` and is planned as one projection with
its base layer's widths (the planner never pairs ``lora_A`` with ``lora_B``: the rank ``r`` between
them is a bottleneck, not a sharded width). Sharded, each part follows the side of the pair it sits on:

* column wrapper (q/k/v, up/gate): ``base`` and ``B`` shard their outputs (ColwiseParallel), ``A``
  stays whole. ``A`` sees the replicated input and its output's gradient comes back all-reduced
  through ``B``'s column input, so its gradient is the full one on every rank.
* row wrapper (o, down): ``base`` and ``A`` shard their inputs (RowwiseParallel: ``A``'s small
  ``r``-wide output is all-reduced), ``B`` stays whole on the full ``A`` output. The dropout before
  ``A`` sees a feature shard: it draws one process's full mask from the shared stream and keeps
  its slice (:func:`feature_sliced`), so masks equal one process's.

Under sequence parallelism the whole adapter (column ``A``, row ``B``) runs on a sequence shard: its
gradient is summed over the tensor ranks. An adapter variant (DoRA's weight-norm magnitude reads the
whole weight) is not split: such a wrapper is no projection to the planner and stays whole.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from composable_atorch.transforms.parallel.shared.probe import is_linear


def is_wrapper(m: nn.Module) -> bool:
    """A peft LoRA layer of any kind (plain, DoRA, merged): the planner never looks inside one."""
    return getattr(m, "base_layer", None) is not None and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)


def lora_base(m: nn.Module) -> nn.Module | None:
    """The base projection of a peft LoRA wrapper of a Linear / Conv1D (plain LoRA only), else None."""
    base = getattr(m, "base_layer", None)
    a, b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
    if base is None or not isinstance(a, nn.ModuleDict) or not isinstance(b, nn.ModuleDict):
        return None
    if not is_linear(base) or getattr(m, "lora_variant", None) or getattr(m, "merged_adapters", None):
        return None
    if not all(isinstance(x, nn.Linear) for x in (*a.values(), *b.values())):
        return None
    return base


def adapters(name: str, m: nn.Module) -> list[tuple[str, str, nn.Module | None]]:
    """``(A name, B name, dropout module)`` of each adapter of a wrapper."""
    drops = getattr(m, "lora_dropout", {})
    keys = [k for k in m.lora_A if k in m.lora_B]
    return [(f"{name}.lora_A.{k}", f"{name}.lora_B.{k}", drops[k] if k in drops else None) for k in keys]


def parts(name: str, m: nn.Module, kind: str) -> list[tuple[str, str]]:
    """The layers a wrapper's ``kind`` shards, as ``(name, kind)``: base and B (column) or base and A (row)."""
    sharded = [(f"{name}.base_layer", kind)]
    for a, b, _ in adapters(name, m):
        sharded.append((b if kind == "col" else a, kind))
    return sharded


def whole(name: str, m: nn.Module, kind: str) -> list[str]:
    """The adapter layers a wrapper keeps whole (A of a column wrapper, B of a row wrapper)."""
    return [a if kind == "col" else b for a, b, _ in adapters(name, m)]


def feature_sliced(module: nn.Module, degree: int, rank: int) -> None:
    """A dropout that sees the last-dim shard ``rank`` of a tensor draws the full mask and keeps its slice."""
    original = module.forward

    def forward(self, x):
        p = getattr(self, "p", 0.0)
        if not self.training or not p:
            return original(x)
        shape = [*x.shape[:-1], x.size(-1) * degree]
        keep = 1 - p
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep).div_(keep)
        return x * noise.narrow(-1, rank * x.size(-1), x.size(-1))

    module.forward = types.MethodType(forward, module)


def expand(shard: dict[str, tuple[str, dict]], modules: dict[str, nn.Module]):
    """The plan's layers with each LoRA wrapper replaced by the layers it shards.

    Returns ``(layers, whole, drops)``: ``{name: (kind, kwargs)}`` to shard, the adapter layers
    kept whole (their gradients are summed under sequence parallelism), and the adapters' dropouts
    with the kind of their wrapper (a row wrapper's sees a feature shard: :func:`feature_sliced`;
    a column wrapper's a sequence shard under sequence parallelism)."""
    layers: dict[str, tuple[str, dict]] = {}
    kept: list[str] = []
    drops: list[tuple[nn.Module, str]] = []
    for n, (kind, kw) in shard.items():
        m = modules[n]
        if lora_base(m) is None:
            layers[n] = (kind, kw)
            continue
        layers.update({p: (k, kw) for p, k in parts(n, m, kind)})
        kept += whole(n, m, kind)
        drops += [(d, kind) for _, _, d in adapters(n, m) if isinstance(d, nn.Dropout)]
    return layers, kept, drops


def local_inputs(model: nn.Module, shard: dict[str, tuple[str, dict]]) -> None:
    """Under sequence parallelism a column wrapper's input is the norm's DTensor (a sequence shard):
    its adapter (dropout, then ``A``, kept whole) runs on the local shard, as ``B``'s column input expects."""
    modules = dict(model.named_modules())

    def to_local(_m, args):
        return tuple(a.to_local() if hasattr(a, "to_local") else a for a in args)

    for n, (kind, _) in shard.items():
        m = modules[n]
        if kind != "col" or lora_base(m) is None:
            continue
        for a, _, drop in adapters(n, m):
            modules[a].register_forward_pre_hook(to_local)
            if drop is not None:
                drop.register_forward_pre_hook(to_local)

"""The generic tensor-parallel planner: column-then-row pairs read from one traced forward.

Names differ between families (``q_proj``/``query``/``c_attn``/``wi``...), the data flow does not:
a Megatron pair is a group of projections whose outputs reach the next projection without passing
through another one (q, k, v -> o; up, gate -> down; fc1 -> fc2), and that next projection writes
back the width the group read (the residual stream). One forward of a zero-weight CPU replica on a
few tokens records, per projection call, which projections its input was computed from
(a taint carried through every torch op by a ``TorchFunctionMode``); the pairs follow from that,
for nn.Linear, GPT-2's Conv1D and peft's LoRA wrappers alike, whatever the layers are called. A plain
chain of Linears (ATorch's plan-free toy models) has no residual: there consecutive Linears pair
col -> row, unless a layer with weights (a norm) runs between them (DeepSeek's latent attention:
q_a -> norm -> q_b is a low-rank chain, not a pair). What no pair places stays whole (replicated).

The same replica, re-made at each rank's local shapes, runs the forward again before any weight
moves (:func:`.resolve.verify`): a pair that would give a shape error is kept whole then, not met
mid-training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from composable_atorch.transforms.example_input import example_input  # noqa: F401 - re-exported
from composable_atorch.transforms.parallel.shared.probe import (  # noqa: F401 - re-exported
    features,
    is_conv1d,
    is_linear,
    replica,
    run,
)
from composable_atorch.transforms.parallel.tensor.lora import is_wrapper, lora_base

#: head counts an attention module reads to reshape its projections (divided by the degree)
HEAD_ATTRS = (
    "num_heads",
    "n_head",
    "n_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_head",
    "n_kv_heads",
)
#: widths some attention modules reshape to; divided only when equal to the sharded width
WIDTH_ATTRS = ("embed_dim", "split_size", "hidden_size", "inner_dim", "all_head_size")
#: fused projections whose parts are laid out per head ([heads, 3, head_dim]): a contiguous shard is right
PER_HEAD_FUSED = ("query_key_value",)
#: fused projections laid out part by part ([3, heads, head_dim]): strided shard when the parts are equal
PART_FUSED = ("c_attn", "qkv", "qkv_proj", "W_pack", "Wqkv", "in_proj")
#: MLP projections fused as [gate | up]
GATE_UP_FUSED = ("gate_up_proj",)


def is_proj(m) -> bool:
    """A projection the planner places: a Linear, GPT-2's Conv1D, or a LoRA wrapper of one (see :mod:`.lora`)."""
    return is_linear(m) or lora_base(m) is not None


def proj_features(m) -> tuple[int, int]:
    """``(in, out)`` of a projection (a LoRA wrapper's are its base layer's)."""
    base = lora_base(m)
    return features(base if base is not None else m)


# ---------------------------------------------------------------------------------------------
# the trace
# ---------------------------------------------------------------------------------------------


class _Taint(TorchFunctionMode):
    """Every op's outputs carry the union of its inputs' taints (sets of projection names)."""

    def __init__(self):
        super().__init__()
        self.of = WeakTensorKeyDictionary()

    def get(self, value) -> frozenset:
        leaves, _ = tree_flatten(value)
        out: set = set()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                out |= self.of.get(x, frozenset())
        return frozenset(out)

    def set(self, value, taint: frozenset) -> None:
        leaves, _ = tree_flatten(value)
        for x in leaves:
            if isinstance(x, torch.Tensor):
                self.of[x] = taint

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        taint = self.get((args, kwargs))
        if taint:
            self.set(out, taint)
        return out


@dataclass
class Call:
    name: str
    taint: frozenset  # the projections this call's input came from (since the last projection)
    linear: bool


@dataclass
class Trace:
    calls: list[Call] = field(default_factory=list)


def trace(model: nn.Module, example) -> Trace:
    """The order of projection (and other parameterised module) calls, each with its input's taint."""
    rep = replica(model)
    mode = _Taint()
    out = Trace()
    seen: set[str] = set()
    handles = []
    wrapped: list[str] = []  # LoRA wrappers: traced as one projection, their inner layers not at all
    for name, m in rep.named_modules():
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        lin = is_proj(m)
        wrapper = is_wrapper(m)  # a DoRA one is no projection: recorded as a layer with weights, never split
        if wrapper:
            wrapped.append(name)
        if not lin and not wrapper and not any(True for _ in m.parameters(recurse=False)):
            continue

        def pre(mod, args, kwargs, name=name, lin=lin):
            if name not in seen:
                seen.add(name)
                out.calls.append(Call(name, mode.get((args, kwargs)), lin))

        def post(mod, args, output, name=name, lin=lin or wrapper):
            if lin:  # a DoRA wrapper's output is its own too: no group takes it for a projection's input
                mode.set(output, frozenset({name}))

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post))
    try:
        with mode:
            run(rep, example)
    finally:
        for h in handles:
            h.remove()
    return out


# ---------------------------------------------------------------------------------------------
# pairs
# ---------------------------------------------------------------------------------------------


@dataclass
class Pair:
    cols: tuple[str, ...]
    row: str
    stride: int = 1
    reason: str = ""  # why a pair is kept whole (replicated); empty when sharded


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def pairs(model: nn.Module, tr: Trace, residual: bool = True) -> list[Pair]:
    """Column groups and their row projection, in forward order (see the module docstring)."""
    modules = dict(model.named_modules())
    placed: set[str] = set()
    out: list[Pair] = []
    # a layer with weights (a norm) run on a column output would see one shard of it; a residual block's
    # per-head norms are summed (partial_grad_modules), a plain chain has no such thing between its pairs
    normed = set().union(*(c.taint for c in tr.calls if not c.linear)) if not residual else set()
    for c in tr.calls:
        if not c.linear or c.name in placed or not c.taint or c.taint & placed:
            continue
        if not all(n in modules and is_proj(modules[n]) for n in c.taint):
            continue
        row_in, row_out = proj_features(modules[c.name])
        ins = {proj_features(modules[n])[0] for n in c.taint}
        if residual and ins != {row_out}:
            continue
        if not residual and (len(c.taint) != 1 or c.taint & normed):
            continue
        cols = tuple(sorted(c.taint))
        placed.update((*cols, c.name))
        out.append(Pair(cols, c.name))
    return out


def heads_of(module: nn.Module) -> dict[str, int]:
    return {a: getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)}


def fused_stride(model: nn.Module, p: Pair) -> Pair:
    """Stride (or a reason to keep whole) for a single fused column projection feeding ``p.row``."""
    modules = dict(model.named_modules())
    if len(p.cols) != 1:
        return p
    col = p.cols[0]
    out_f = proj_features(modules[col])[1]
    row_in = proj_features(modules[p.row])[0]
    if out_f == row_in:
        return p
    leaf = col.rpartition(".")[2]
    att = modules[_parent(col)]
    heads = set(heads_of(att).values())
    uneven = len(heads) > 1 or bool(getattr(att, "multi_query", False))
    if out_f % row_in:
        return Pair(p.cols, p.row, 1, f"{col}: fused parts of unequal size ({out_f} outputs for {row_in} inputs)")
    k = out_f // row_in
    if leaf in PER_HEAD_FUSED:
        if uneven:
            return Pair(p.cols, p.row, 1, f"{col}: fused per-head projection with grouped key/value heads")
        return Pair(p.cols, p.row, 1)
    if leaf in PART_FUSED and k != 3:
        return Pair(p.cols, p.row, 1, f"{col}: fused q/k/v of unequal sizes (grouped key/value heads)")
    if leaf in PART_FUSED and uneven:
        return Pair(p.cols, p.row, 1, f"{col}: fused q/k/v with grouped key/value heads")
    return Pair(p.cols, p.row, k)


def shrink_attrs(model: nn.Module, p: Pair) -> dict[str, tuple[str, ...]]:
    """The attention modules of a pair and the head counts / widths they read, to divide by the degree."""
    modules = dict(model.named_modules())
    width = proj_features(modules[p.row])[0]
    out: dict[str, tuple[str, ...]] = {}
    for name in {_parent(c) for c in p.cols}:
        m = modules[name]
        attrs = [a for a in heads_of(m)]
        if attrs:
            attrs += [a for a in WIDTH_ATTRS if getattr(m, a, None) == width]
            out[name] = tuple(sorted(attrs))
    return out


def head_embeddings(model: nn.Module, p: Pair) -> list[str]:
    """Per-head tables inside the attention module (T5's relative_attention_bias: one column per head)."""
    modules = dict(model.named_modules())
    out = []
    for name in {_parent(c) for c in p.cols}:
        heads = set(heads_of(modules[name]).values())
        for child, m in modules[name].named_children():
            if isinstance(m, nn.Embedding) and m.embedding_dim in heads:
                out.append(f"{name}.{child}" if name else child)
    return out


def partial_grad_modules(tr: Trace, p: Pair, sharded: set[str]) -> list[str]:
    """Replicated modules that run on a pair's sharded activations (Qwen3's q_norm / k_norm): each rank
    sees its heads only, so their gradients are summed over the tensor ranks."""
    cols = set(p.cols)
    return [c.name for c in tr.calls if not c.linear and c.taint and c.taint <= cols and c.name not in sharded]


# ---------------------------------------------------------------------------------------------
# how a column projection's output is read
# ---------------------------------------------------------------------------------------------

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten}


class _Views(TorchFunctionMode):
    """Records the shapes a column projection's own output is viewed into (split into heads)."""

    def __init__(self, outputs: dict[int, str]):
        super().__init__()
        self.outputs, self.seen = outputs, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _VIEWS and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.outputs:
            src = args[0]
            if isinstance(out, torch.Tensor) and out.dim() > src.dim():
                self.seen.setdefault(self.outputs[id(src)], []).append(tuple(out.shape))
        return out


def split_views(rep: nn.Module, example, cols) -> dict[str, list[tuple]]:
    """``{column projection: [shapes its output is split into]}`` for one forward of ``rep``."""
    outputs: dict[int, str] = {}
    keep: list = []  # the outputs stay alive (ids are not reused) until the forward is done
    modules = dict(rep.named_modules())
    handles = []
    for n in cols:

        def post(mod, args, output, n=n):
            if isinstance(output, torch.Tensor):
                outputs[id(output)] = n
                keep.append(output)

        handles.append(modules[n].register_forward_hook(post))
    mode = _Views(outputs)
    try:
        with mode:
            run(rep, example)
    finally:
        for h in handles:
            h.remove()
    return mode.seen


def fixed_head_reads(whole: dict, local: dict) -> list[str]:
    """Column projections whose output a rank splits into smaller heads than the whole model does
    (the innermost size changed): the head count is fixed in the forward, not read from the width,
    so a shard is read as all the heads at a fraction of their size."""
    return sorted(n for n, shapes in whole.items() if [s[-1] for s in shapes] != [s[-1] for s in local.get(n, [])])

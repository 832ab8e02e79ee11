"""Fast estimates of deep models: the repeated blocks simulated at two small depths, the rest extrapolated.

A transformer's layers are copies of one block (same class, same parameter shapes), and everything
the estimate measures grows by the same amount per layer: parameters, gradients and optimizer
states per block, the activations a block keeps for the backward (or its boundary under
checkpointing), FSDP's per-block all-gathers and reduce-scatters, the ops and FLOPs of its forward
and backward. So a model of ``n`` blocks costs ``q(k1) + (n - k1) * (q(k2) - q(k1))`` for each such
quantity ``q``, measured on copies of the model truncated to ``k1`` and ``k2`` blocks. Two depths,
not one, so that what is not per block (embeddings, the head, the loss, the first and last block's
edge effects such as FSDP's root) is measured rather than assumed; ``k1 = 2`` keeps a first and a
last block apart from each other. A third depth checks the line: where the peak moves from one
phase of the step to another as blocks are added (DDP's buckets filling up, a checkpointed
backward overtaking the optimizer step), the bytes at the third depth are off the line and the
whole model is simulated instead. A 32-layer Llama is simulated as 2 + 3 + 4 layers.

Pipeline plans are not truncated (their stage cut depends on the depth), nor plans with DDP (its
gradient buckets, added as stand-ins, are filled across blocks up to 25 MiB each, so what of them
is alive at the peak is not per block): they are simulated whole.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace

import torch

from composable_atorch.estimate.simulate import BUCKET_CAPS, RankRun
from composable_atorch.estimate.steptime import OpTrace

#: the depths simulated (the third checks the line through the first two), and the depth from
#: which truncating pays (9 blocks simulated in all)
DEPTHS = (2, 3, 4)
AUTO_FROM = 8


def _signature(module: torch.nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def find_blocks(model: torch.nn.Module) -> tuple[str, int] | None:
    """``(qualified name, count)`` of the model's longest ModuleList / Sequential of identical blocks, or None."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList | torch.nn.Sequential) or len(module) < 2:
            continue
        children = list(module)
        first = _signature(children[0])
        if not first[1] or any(_signature(c) != first for c in children[1:]):
            continue
        if best is None or len(children) > best[1]:
            best = (name, len(children))
    return best


def truncated(model: torch.nn.Module, name: str, depth: int) -> torch.nn.Module:
    """A copy of ``model`` (meta) whose block list ``name`` keeps its first ``depth`` blocks; a config
    saying how many layers there are (Hugging Face's ``num_hidden_layers``, ``n_layer``) says so too."""
    with torch.device("meta"):
        out = copy.deepcopy(model)
    parent_name, _, attr = name.rpartition(".")
    parent = out.get_submodule(parent_name) if parent_name else out
    blocks = getattr(parent, attr) if attr else out
    n = len(blocks)
    kept = type(blocks)(list(blocks)[:depth]) if attr else None
    if attr:
        setattr(parent, attr, kept)
    for config in {id(c): c for c in (getattr(m, "config", None) for m in out.modules()) if c is not None}.values():
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if getattr(config, key, None) == n:
                setattr(config, key, depth)
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) == n:
            config.layer_types = types[:depth]
    return out


def _line(a: float, b: float, k1: int, k2: int, n: int) -> float:
    return a + (n - k1) * (b - a) / (k2 - k1)


def _int_line(a: int, b: int, k1: int, k2: int, n: int) -> int:
    return max(0, round(_line(a, b, k1, k2, n)))


def extrapolate(small: RankRun, large: RankRun, k1: int, k2: int, n: int) -> RankRun:
    """The run of the ``n``-block model from the runs of its ``k1``- and ``k2``-block copies."""
    kinds = set(small.by_kind) | set(large.by_kind)
    by_kind = {k: _int_line(small.by_kind.get(k, 0), large.by_kind.get(k, 0), k1, k2, n) for k in kinds}
    trace = None
    if small.trace is not None and large.trace is not None:
        trace = OpTrace()
        ops = Counter()
        for key in set(small.trace.ops) | set(large.trace.ops):
            count = _int_line(small.trace.ops.get(key, 0), large.trace.ops.get(key, 0), k1, k2, n)
            if count:
                ops[key] = count
        trace.ops, trace.op_count = ops, _int_line(small.trace.op_count, large.trace.op_count, k1, k2, n)
        trace.fused_ops = _int_line(small.trace.fused_ops, large.trace.fused_ops, k1, k2, n)
        trace.fused_kernels = _int_line(small.trace.fused_kernels, large.trace.fused_kernels, k1, k2, n)
    total = _int_line(sum(small.allreduce_buckets), sum(large.allreduce_buckets), k1, k2, n)
    buckets = []
    while total > 0:  # DDP's buckets of the whole model: the first up to 1 MiB, the rest up to 25 MiB
        cap = BUCKET_CAPS[0 if not buckets else 1]
        buckets.append(min(cap, total))
        total -= buckets[-1]
    return replace(
        large,
        by_kind=by_kind,
        peak=by_kind.get("Total", 0),
        grad_bytes=_int_line(small.grad_bytes, large.grad_bytes, k1, k2, n),
        flops=None if small.flops is None else _int_line(small.flops, large.flops, k1, k2, n),
        extra_temporary=_int_line(small.extra_temporary, large.extra_temporary, k1, k2, n),
        trace=trace,
        allreduce_buckets=buckets,
        paper=None if small.paper is None or large.paper is None else small.paper.extrapolate(large.paper, k1, k2, n),
        step_time_s=None
        if small.step_time_s is None or large.step_time_s is None
        else max(0.0, _line(small.step_time_s, large.step_time_s, k1, k2, n)),
    )

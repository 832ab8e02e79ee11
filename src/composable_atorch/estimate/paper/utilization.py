"""Throughput per device, model FLOPs, MFU and HFU, counted as PaLM and Megatron count them.

* Model FLOPs per step: ``6 N T`` (forward and backward of every weight once; ``N`` the parameters
  a token multiplies: without embedding lookups, and a mixture of experts' stacked experts at
  ``top_k / num_experts`` of their size, as torchtitan counts MoE models' active parameters; ``T``
  the step's tokens) plus attention,
  ``12 L H Q T`` per token in PaLM's appendix B (Chowdhery et al., arXiv 2204.02311): the scores and
  their product with the values, forward (4 ``s d`` per token and layer) and backward (twice that).
  Attention is counted whole, not halved for a causal mask (PaLM, Megatron-LM, torchtitan do the
  same). Here it is read from the simulated step itself: 1.2 x the FLOPs of its attention backward
  calls (torch's flop counter gives a backward 2.5 forwards: the scores recomputed), so a tensor- or
  sequence-parallel rank counts its own share, and a checkpoint's recomputed forward is not counted.
* MFU: model FLOPs per second per device over the dense peak of the dtype the matmuls run in
  (bf16 for an fp8 plan: torchao's fp8 runs part of the step in bf16 and MFU counts bf16's peak, as
  torchtitan notes).
* HFU: the FLOPs the device really executes (torch's flop counter over the simulated step: a
  checkpoint's recompute included) over the same peak, as seed 002's table counts it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

MATMUL_DTYPES = ("float32", "bfloat16", "float16", "float8")


#: where a mixture-of-experts block keeps its experts per token: on itself or its router (transformers
#: 5's MoE blocks: ``top_k``; a user block following the experts protocol: ``k``), else the config's
_TOP_K = ("top_k", "num_experts_per_tok", "k")


def _experts_per_token(model: torch.nn.Module, parent: torch.nn.Module, experts: int) -> int | None:
    for owner in (parent, *parent.children()):
        for attr in _TOP_K:
            k = getattr(owner, attr, None)
            if isinstance(k, int) and not isinstance(k, bool) and 0 < k <= experts:
                return k
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    return k if isinstance(k, int) and 0 < k <= experts else None


def _expert_weights(model: torch.nn.Module) -> dict[int, float]:
    """``id(parameter) -> the share of it a token multiplies`` for stacked experts (1 elsewhere)."""
    from composable_atorch.transforms.parallel.expert.families import follows_protocol

    modules = dict(model.named_modules())
    share: dict[int, float] = {}
    for name, m in modules.items():
        if follows_protocol(m) and not any(id(p) in share for p in m.parameters()):
            k = _experts_per_token(model, modules[name.rpartition(".")[0]], m.num_experts)
            if k is not None:
                share.update((id(p), k / m.num_experts) for p in m.parameters())
    return share


def lookup_free_params(model: torch.nn.Module) -> float:
    """The parameters a token multiplies: without embedding lookups (an embedding tied to an output
    Linear is counted once), stacked experts at their ``top_k / num_experts`` share (an MoE's MFU
    over all experts read 145% for a Mixtral-shaped model)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {
        id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear
    }
    share = _expert_weights(model)
    seen, n = set(), 0.0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in lookups:
            n += p.numel() * share.get(id(p), 1.0)
        seen.add(id(p))
    return n


def attention_flops(ops) -> float:
    """Model attention FLOPs of one rank's step from its op counts (``OpTrace.ops``)."""
    return 3.0 / 2.5 * sum(size * n for (kind, _, size), n in ops.items() if kind == "sdpa_bwd")


def matmul_dtype(events) -> str:
    """The dtype most matmul FLOPs of a rank's step run in (fp8 read as bf16 for the peak). Read from the
    trace's events, whose GEMMs carry the dtype the device runs them in: a float8 Linear's GEMM is
    "float8" there, whatever dtype this CPU's emulation counted it in (an fp32 model with fp8 Linears
    would otherwise be measured against the fp32 peak, and show an MFU over 100%)."""
    totals = dict.fromkeys(MATMUL_DTYPES, 0.0)
    for ev in events:
        if ev.kind in ("mm", "sdpa", "sdpa_bwd"):
            key = "float8" if ev.dtype.startswith("float8") else ev.dtype
            if key in totals:
                totals[key] += ev.size
    best = max(totals, key=totals.get)
    return "bfloat16" if best == "float8" or totals[best] == 0 else best


@dataclass(frozen=True)
class Utilization:
    """What one step does per device (the JSON of ``estimate --json`` carries these names)."""

    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float
    hfu: float
    model_flops: float  # per step, all devices
    hardware_flops_per_device: float  # per step
    peak_flops: float
    peak_dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


def utilization(
    *,
    seconds: float,
    world: int,
    tokens: float,
    params: float,
    attention_per_stage: list[float],
    flops_per_stage: list[float],
    peak: float,
    peak_dtype: str,
) -> Utilization:
    """``tokens`` of the global step; per-stage lists hold one simulated rank of each pipeline stage
    (one entry without a pipeline; every stage has ``world / stages`` ranks)."""
    stages = max(1, len(flops_per_stage))
    model = 6.0 * params * tokens + sum(attention_per_stage) * world / stages
    hardware = sum(flops_per_stage) / stages
    tflops = model / world / seconds
    return Utilization(
        tokens_per_s_per_device=tokens / world / seconds,
        tflops_per_device=tflops / 1e12,
        mfu=tflops / peak,
        hfu=hardware / seconds / peak,
        model_flops=model,
        hardware_flops_per_device=hardware,
        peak_flops=peak,
        peak_dtype=peak_dtype,
    )

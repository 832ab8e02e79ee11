"""The estimate's shortcuts give the full estimate, and the fake world allocates and remembers nothing.

Shortcuts (estimate/dedup.py): a model of repeated blocks simulated at a few depths, the window of
depths sliding deeper while the line does not hold (a context split's backward peaks in its second
block); a plan repeating micro-steps (a 1F1B pipeline's micro-batches, gradient accumulation)
simulated with a few of them. Each is checked against the whole simulation: the very bytes and
FLOPs, and the same seconds on paper. Fake world: tensor parallel's planner traces a replica of
fake tensors (no real weights), the pipeline's per-layer check is skipped on fake tensors (it
compares values), and a rank simulated after another of the same layout gets its own meshes
(DTensor's caches forgotten between simulated ranks).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import composable_atorch as ca
from composable_atorch.estimate import estimate

SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=512)


def llama(layers: int):
    return lambda: AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=layers, **SMALL))


def criterion(output, targets):
    logits = output.logits if hasattr(output, "logits") else output
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def env(world: int):
    return ca.Environment.detect().with_(world_size=world, device="cuda", compute_capability=(8, 0))


def both(plan, model, batch, world: int, **kw):
    run = dict(world_size=world, device="cuda", hardware="a100-80gb-sxm", **kw)
    return estimate(plan, model, batch, dedup=None, **run), estimate(plan, model, batch, dedup=False, **run)


def assert_same(fast, full):
    assert [r.peak for r in fast.ranks] == [r.peak for r in full.ranks]
    assert fast.ranks == full.ranks
    assert fast.flops == full.flops
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)


def test_context_split_extrapolated_over_a_sliding_window_is_the_whole_estimate():
    plan = ca.compose(
        ca.parallel_mode([("context", 2), ("data", 2)]),
        ca.context_parallel(),
        ca.fsdp(wrap=LlamaDecoderLayer),
        ca.amp("bf16"),
        ca.checkpoint(LlamaDecoderLayer),
        env=env(4),
    )
    shape = torch.Size([4, 256])
    fast, full = both(plan, llama(10), (shape, shape), 4, criterion=criterion)
    assert any("extrapolated per block" in n for n in fast.notes), fast.notes
    assert_same(fast, full)


def test_pipeline_micro_batches_extrapolated_are_the_whole_estimate():
    plan = ca.compose(
        ca.parallel_mode([("pipeline", 2), ("data", 2)]),
        ca.pipeline_parallel(microbatches=16),
        ca.amp("bf16"),
        ca.checkpoint(LlamaDecoderLayer),
        env=env(4),
    )
    # the first stage's activations reach their line at 3 micro-batches: the window slides to 3, 4, 5
    shape = torch.Size([32, 32])
    fast, full = both(plan, llama(2), (shape, shape), 4, criterion=criterion)
    assert any("micro-steps" in n and "extrapolated to 16" in n for n in fast.notes), fast.notes
    assert fast.micro_batches == full.micro_batches == 16
    assert_same(fast, full)


def test_gradient_accumulation_extrapolated_is_the_whole_estimate():
    plan = ca.compose(ca.fsdp(wrap=LlamaDecoderLayer), ca.amp("bf16"), ca.accumulate(8), env=env(2))
    shape = torch.Size([16, 64])
    fast, full = both(plan, llama(2), {"input_ids": shape, "labels": shape}, 2)
    assert any("gradient accumulation simulated with" in n for n in fast.notes), fast.notes
    assert_same(fast, full)


def test_tensor_x_pipeline_of_a_transformers_llama_estimates_each_stage():
    """The second stage is simulated after the first in a fresh fake world: it must shard over its
    own meshes (DTensor's sharding caches, keyed by meshes that compare equal across ranks, are
    forgotten), and the pipeline's per-layer check, which compares values, is skipped on fake tensors."""
    plan = ca.compose(ca.mixed_parallel(tensor=2, pipeline=2, microbatches=2), ca.amp("bf16"), env=env(4))
    shape = torch.Size([2, 64])
    est = estimate(
        plan, llama(4), (shape, shape), world_size=4, device="cuda", hardware="a100-80gb-sxm", criterion=criterion
    )
    assert {r.stage for r in est.ranks} == {0, 1}
    assert est.step_time_s > 0


def test_tensor_parallel_planner_replica_of_a_fake_model_is_fake():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from composable_atorch.transforms.parallel.shared.probe import replica

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    rep = replica(model)
    tensors = [*rep.parameters(), *rep.buffers()]
    assert tensors and all(isinstance(t, FakeTensor) and t.fake_mode is mode for t in tensors)
    real = replica(torch.nn.Linear(4, 4))  # a real model keeps a real zero replica
    assert not isinstance(real.weight, FakeTensor) and not real.weight.any()

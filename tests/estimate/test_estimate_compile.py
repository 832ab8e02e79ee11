"""estimate of plans the fake world cannot run as they are: compile (priced, never run), a compiler
inside the user's own forward, and engines that cannot run on fake tensors (a typed refusal).

The compiler is never run on the estimate's fake tensors (inductor generated and ran CPU kernels
there and the process died of SIGSEGV): the step is simulated eagerly and priced by
``steptime.Fusion``'s rule. What is checked: the estimate returns on a Llama-3-8B shape at world 8
and on every family the estimate tests cover, with the eager step's memory, the same FLOPs, and a
step time no slower than eager (strictly faster where the backend fuses); the rule itself on a
hand-built trace.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import composable_atorch as ca
import zoo
from composable_atorch.environment import Environment
from composable_atorch.estimate import EstimateError, estimate
from composable_atorch.estimate.steptime import OpTrace
from composable_atorch.models import GPT, Block, GPTConfig
from zoo import moe as mm


def llama3_8b():
    from transformers import LlamaConfig, LlamaForCausalLM

    from composable_atorch.cli.estimate import LLAMA3_8B

    return LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))


def _finite(e) -> None:
    assert all(math.isfinite(r.peak) and r.peak > 0 for r in e.ranks), e.ranks
    assert e.flops is None or e.flops > 0


def test_llama3_8b_fsdp_amp_checkpoint_compile_at_world_8_returns():
    """The plan that died of SIGSEGV (inductor on fake tensors); its memory equals the eager plan's
    (checked on the small families below, where both are quick)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ids = torch.Size([8, 2048])
    plan = ca.fsdp() | ca.amp("bf16") | ca.checkpoint(LlamaDecoderLayer) | ca.compile()
    est = estimate(plan, llama3_8b, {"input_ids": ids, "labels": ids}, world_size=8, device="cuda")
    _finite(est)
    assert len(est.ranks) == 8 and "compile" in est.steps
    note = next(n for n in est.notes if n.startswith("compile(inductor"))
    assert "simulated eagerly" in note and "Memory: the eager step's activations" in note
    assert any("32 identical blocks" in n for n in est.notes)  # deduplicated: fast


GPT_TASK = dict(seq_len=32, d_model=32, n_layer=2, n_head=4)


def _gpt():
    return GPT(GPTConfig(vocab_size=256, **GPT_TASK))


def _gpt_loss(model, batch):
    from composable_atorch.models.gpt import lm_loss

    x, y = batch
    return lm_loss(model(x), y)


def _case(name: str):
    """(model factory, batch, loss_fn) of a family the estimate tests cover."""
    if name == "gpt":
        shape = torch.Size([4, GPT_TASK["seq_len"]])
        return _gpt, (shape, shape), _gpt_loss
    if name in mm.FAMILIES or name == "qwen2_moe":
        return lambda: mm.build(name), mm.batch(0, 4), lambda m, b: mm.loss(name, m, b)
    return lambda: zoo.build(name), zoo.batch(name), lambda m, b: zoo.zoo_loss(name, m, b)


def _compare(name: str, compile_step, world: int = 1, steps=()):
    """The estimates of ``steps + compile_step`` and of ``steps`` alone."""
    build, batch, loss = _case(name)
    env = Environment.detect().with_(world_size=world)
    kw = dict(world_size=world, device="cpu", loss_fn=loss)
    return tuple(estimate(ca.compose(*s, env=env), build, batch, **kw) for s in ((*steps, compile_step), steps))


#: the families tests/estimate covers: the built-in GPT, Llama and the user model (sequence splits), the MoE families
COVERED = ["gpt", "llama", "user", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
OTHER_ZOO = [n for n in zoo.ZOO if n not in COVERED]


def _check_fused(name: str) -> None:
    compiled, eager = _compare(name, ca.compile())
    _finite(compiled)
    # memory and FLOPs: the eager step's; the step: fewer memory-bound kernels and per-op costs
    assert compiled.ranks == eager.ranks and compiled.flops == eager.flops
    assert compiled.step_time.compute < eager.step_time.compute
    assert compiled.step_time.overhead < eager.step_time.overhead
    assert compiled.step_time_s < eager.step_time_s
    assert any("priced as fused" in n for n in compiled.notes), compiled.notes


@pytest.mark.parametrize("name", COVERED)
def test_compile_is_priced_not_run_on_every_family_the_estimate_covers(name):
    _check_fused(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_ZOO)
def test_compile_is_priced_not_run_on_the_rest_of_the_zoo(name):
    _check_fused(name)


def test_a_backend_that_fuses_nothing_is_priced_as_the_eager_step():
    compiled, eager = _compare("gpt", ca.compile(backend="aot_eager"))
    assert compiled.ranks == eager.ranks and compiled.step_time == eager.step_time
    assert any("fuses nothing" in n for n in compiled.notes)


def test_fsdp_amp_checkpoint_compile_at_world_2_is_priced():
    steps = (ca.fsdp(wrap=Block), ca.amp("bf16"), ca.checkpoint(Block))
    compiled, eager = _compare("gpt", ca.compile(), world=2, steps=steps)
    assert compiled.ranks == eager.ranks and len(compiled.ranks) == 2
    assert compiled.step_time.comm == pytest.approx(eager.step_time.comm)  # collectives are not fused
    assert compiled.step_time_s < eager.step_time_s


def test_a_compiler_inside_the_users_forward_is_not_run():
    """A forward that calls a compiled function (libraries do): the simulation runs its eager code."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    @torch.compile(backend=backend)
    def scaled(x):
        return torch.nn.functional.gelu(x) * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return scaled(self.fc(x))

    est = estimate(
        ca.compose(env=Environment.detect()),
        Model,
        torch.randn(4, 16),
        world_size=1,
        device="cpu",
        loss_fn=lambda m, b: m(b).sum(),
    )
    _finite(est)
    assert calls == []


class Pointwise(nn.Module):
    """Three memory-bound ops: a broadcast multiply (reads x and w), an add and a relu."""

    def __init__(self, k: float):
        super().__init__()
        self.w = nn.Parameter(torch.full((8,), k))

    def forward(self, x):
        return (x * self.w + 1).relu()


def _memory(trace: OpTrace) -> dict:
    return {key: n for key, n in trace.ops.items() if key[0] == "memory"}


def test_fusion_rule_one_kernel_per_run_of_memory_ops_moving_its_largest_ops_bytes():
    lin = nn.Linear(8, 8)
    region = nn.Sequential(nn.Linear(8, 8), Pointwise(2.0), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    eager, fused = OpTrace(), OpTrace([region])
    for trace in (eager, fused):
        with trace, torch.no_grad():
            lin(region(x)).sigmoid()  # lin and sigmoid: outside the region
    assert {k: n for k, n in fused.ops.items() if k[0] == "mm"} == {k: n for k, n in eager.ops.items() if k[0] == "mm"}
    tensor, weight = 4 * 8 * 4.0, 8 * 4.0  # bytes of x (and of each op's output), of w
    # eager: mul moves x, w and its output; add, relu and the sigmoid x and their output
    assert _memory(eager) == {("memory", "float32", 2 * tensor + weight): 1, ("memory", "float32", 2 * tensor): 3}
    # compiled: mul, add, relu are one kernel priced at the largest (the mul's); the sigmoid outside as eager
    assert _memory(fused) == {("memory", "float32", 2 * tensor + weight): 1, ("memory", "float32", 2 * tensor): 1}
    assert fused.fused_ops == 3 and fused.fused_kernels == 1
    assert eager.op_count - fused.op_count == 2  # the per-op cost: once for the kernel, not three times


def test_fusion_runs_end_at_a_compiled_modules_edge_and_cover_its_backward():
    model = nn.Sequential(Pointwise(2.0), Pointwise(3.0))  # two compiled blocks back to back
    x = torch.randn(4, 8, requires_grad=True)
    forward = OpTrace(list(model))
    with forward, torch.no_grad():
        model(x)
    assert forward.fused_ops == 6 and forward.fused_kernels == 2  # two compiled modules: two kernels, not one
    both = OpTrace(list(model))
    with both:
        model(x).sum().backward()
    assert both.fused_ops > forward.fused_ops and both.fused_kernels > 2  # the backward of each is fused too


# -- steps that cannot run on fake tensors: a typed refusal, before any work ----------------------


def test_deepspeed_engines_are_refused_before_any_work(monkeypatch):
    from composable_atorch.estimate import core

    pytest.importorskip("deepspeed")
    monkeypatch.setattr(core, "simulate_rank", lambda *a, **k: pytest.fail("simulated"))
    env = Environment.detect().with_(world_size=2)
    shape = torch.Size([4, GPT_TASK["seq_len"]])
    for step in (ca.zero2(backend="deepspeed"), ca.fsdp(backend="deepspeed")):
        with pytest.raises(EstimateError, match="torch backends zero1"):
            estimate(ca.compose(step, env=env), _gpt, (shape, shape), world_size=2, device="cpu", loss_fn=_gpt_loss)


def test_a_step_that_fails_on_fake_tensors_is_a_typed_error_naming_it():
    pytest.importorskip("fairscale")
    env = Environment.detect().with_(world_size=2)
    shape = torch.Size([4, GPT_TASK["seq_len"]])
    plan = ca.compose(ca.zero2(backend="fairscale"), env=env)
    with pytest.raises(EstimateError, match=r"zero2\(fairscale.*cannot be applied on fake tensors"):
        estimate(plan, _gpt, (shape, shape), world_size=2, device="cpu", loss_fn=_gpt_loss)

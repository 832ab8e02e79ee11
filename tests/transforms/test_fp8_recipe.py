"""fp8(recipe=...): torchao's scaling recipes by name, checked before any work and kept through JSON."""

from __future__ import annotations

import pytest
import torch

import composable_atorch as ca
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError
from composable_atorch.transforms import fp8 as fp8_module

pytest.importorskip("torchao")


def env():
    return Environment.detect().with_(device="cuda", hardware="h100-sxm")


def test_unknown_recipe_and_conflicts_are_refused():
    with pytest.raises(ConfigError, match="rowwise"):
        ca.fp8(recipe="row-wise")
    with pytest.raises(ConfigError, match="transformer_engine"):
        ca.fp8(recipe="rowwise", backend="transformer_engine")
    with pytest.raises(ConfigError, match="HYBRID"):
        ca.fp8(recipe="tensorwise", fp8_format="E4M3")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_recipe_resolves_to_torchao_and_round_trips(recipe):
    plan = ca.compose(ca.fp8(recipe=recipe, exclude=("lm_head",)), env=env())
    step = plan.steps[0].transform
    assert step.backend == "torchao" and step.recipe == recipe
    again = Plan.from_dict(plan.to_dict(), env=env())
    assert again.steps[0].transform == step
    assert recipe in step.describe()


def test_rowwise_linear_trains_emulated_on_this_cpu():
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = ca.compose(ca.fp8(recipe="rowwise"), env=Environment.detect())
    model, optim, _ = plan(model, optim, None)
    linear = model[0]
    assert type(linear).__name__ == "Float8Linear"
    assert "AXISWISE" in str(linear.config.cast_config_input.scaling_granularity)
    x = torch.randn(8, 32)
    out, want = model(x), reference(x)
    assert not torch.equal(out, want)  # fp8 rounding happened
    assert torch.allclose(out, want, rtol=0.1, atol=0.05)  # within e4m3's ~2 significant digits
    out.square().mean().backward()
    reference(x).square().mean().backward()
    assert torch.allclose(linear.weight.grad, reference[0].weight.grad, rtol=0.2, atol=0.02)


def test_the_paper_trace_sees_float8_gemms_forward_and_backward():
    from composable_atorch.estimate.paper.trace import OrderedTrace

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    plan = ca.compose(ca.fp8(recipe="tensorwise"), env=Environment.detect())
    model, _, _ = plan(model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    trace = OrderedTrace()
    with trace:
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    gemms = [e for e in trace.events if e.kind == "mm"]
    assert len(gemms) == 6 and all(e.dtype == "float8" for e in gemms)  # 2 Linears x (forward, dX, dW)
    assert any(e.kind == "memory" and e.dtype == "float32" for e in trace.events)  # the scales' amax and casts


def test_a_torchao_without_the_recipe_skips_with_the_reason(monkeypatch):
    monkeypatch.setattr(fp8_module, "_recipe_missing", lambda name: f"this torchao has no {name!r} recipe")
    plan = ca.compose(ca.fp8(recipe="rowwise"), env=env())
    assert not plan.steps and "no 'rowwise' recipe" in plan.explain()

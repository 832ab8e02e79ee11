"""estimate on transformers 5 mixtures of experts (one process; expert_parallel: test_estimate_expert.py).

The MoE families (tests/zoo/moe.py) run ``grouped_mm`` on 3-D expert weights, whose fake
registration takes bf16 only: estimate routes fake tensors through transformers' own fallback
(estimate/kernels.py).
"""

from __future__ import annotations

import pytest
import torch

import composable_atorch as ca
from composable_atorch.environment import Environment
from composable_atorch.estimate.core import estimate
from zoo import moe as mm

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]
BATCH = {"input_ids": (4, mm.SEQ), "labels": (4, mm.SEQ)}


def _estimate(name, plan, world=2):
    return estimate(
        plan,
        lambda: mm.build(name),
        BATCH,
        world_size=world,
        loss_fn=lambda m, b: m(**b).loss,
        optimizer=lambda m: torch.optim.AdamW(m.parameters()),
        step_time=False,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_families_are_estimated(name):
    params = sum(p.numel() * p.element_size() for p in mm.build(name).parameters())
    result = _estimate(name, ca.compose(ca.ddp(), env=Environment(world_size=2)))
    # weights, grads and AdamW's two moments are all held at the peak of a replicated step
    assert result.peak >= 3 * params, (result.peak, params)


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_peak_within_bound_of_the_measured_peak(name):
    """One process, no splitting steps: the estimate against MemTracker over a real step (the
    estimate tests' way of measuring), within 10 %."""
    from composable_atorch.auto.worker import peak_bytes_of_step

    torch.manual_seed(0)
    model = mm.build(name)
    optim = torch.optim.AdamW(model.parameters())
    ids = mm.batch(0, 4)

    def step(before_micro=None):
        if before_micro is not None:
            before_micro()
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()

    step()
    step()
    peak = peak_bytes_of_step(step, model, optim, "cpu")[0]
    predicted = _estimate(name, ca.compose(), world=1).peak
    assert abs(predicted - peak) / peak <= 0.10, (predicted, peak)

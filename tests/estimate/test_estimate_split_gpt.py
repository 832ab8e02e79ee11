"""estimate of the sequence splits against a real gloo world: context 2 (all-gather and ring) and
Ulysses 2 on the built-in GPT (its SDPA twin, global position_ids), each rank's predicted peak within
10 % of the rank's measured one (MemTracker over a step after warm-up, as the trial worker measures);
and the per-rank activations fall with the context degree."""

from __future__ import annotations

import pytest
import torch

import _seq
import composable_atorch as ca
from composable_atorch.auto.workload import GPTTask
from composable_atorch.estimate import estimate

from _dist import run_world

BOUND = 0.10
TASK = GPTTask(seq_len=128, d_model=64, n_layer=2, n_head=4, batch_size=4)
ENV2 = ca.Environment.detect().with_(world_size=2)


def _plans() -> dict[str, str]:
    fused = ca.module_replace()  # the GPT's SDPA attention: what a split intercepts
    return {
        "context": ca.compose(fused, ca.parallel_mode([("context", 2)]), ca.context_parallel(), env=ENV2),
        "ring": ca.compose(fused, ca.parallel_mode([("context", 2)]), ca.context_parallel(rotation="ring"), env=ENV2),
        "ulysses": ca.compose(fused, ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel(), env=ENV2),
    }


def predict(plan, world: int, task: GPTTask = TASK) -> int:
    shape = torch.Size([task.batch_size, task.seq_len])
    return estimate(
        plan, task.model, (shape, shape), world_size=world, device="cpu", loss_fn=task.loss, optimizer=task.optimizer
    ).peak


def _measure(rank, world, plans):
    return {name: _seq.measured_peak(text, TASK) for name, text in plans.items()}


@pytest.mark.dist
def test_each_ranks_peak_within_bound_of_a_gloo_world():
    plans = {name: plan.to_json() for name, plan in _plans().items()}
    measured = run_world(_measure, 2, plans)
    for name, text in plans.items():
        predicted = predict(text, 2)
        for rank in (0, 1):
            peak = measured[rank][name]
            assert abs(predicted - peak) / peak <= BOUND, (name, rank, predicted, peak)


def test_activations_per_rank_fall_with_the_context_degree():
    """At the same batch, context 2 holds half of each sequence per rank: what the step adds on top
    of the weights, gradients and AdamW state (4 copies of the parameters) falls to about half."""
    params = sum(p.numel() * 4 for p in TASK.model().parameters())
    whole = predict(ca.compose(ca.module_replace(), env=ca.Environment.detect().with_(world_size=1)), 1)
    split = predict(_plans()["context"], 2)
    assert split < whole
    assert (split - 4 * params) < 0.65 * (whole - 4 * params), (split, whole, params)

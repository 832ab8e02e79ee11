"""Several pipeline stages per rank on any model the cutter can cut: Interleaved1F1B,
InterleavedZeroBubble (loop placement) and ZBVZeroBubble (V placement) at 2 stages per rank, on a
transformers Llama, a plain user model and a tied Gemma 2 (its embedding on the V's first and
last stage, both on rank 0), at pipeline 2 x data 2 (world 4), equal to one process on the same
global batches with SGD and AdamW; LoopedBFS and DualPipeV on the user model, and tensor 2 x
pipeline 2 (mixed_parallel) interleaved on the Llama.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import composable_atorch as ca
import equivalence as eq
from zoo import pipeline as zx

from _dist import run_world

STEPS, BATCH, TOL = 3, 8, 1e-4
OPTIMS = eq.PIPELINE
MODELS = {"llama": zx.llama, "user": zx.user, "gemma2": lambda: zx.build_layers("gemma2", 4)}
SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
CASES = [(m, s, o) for m in ("llama", "user") for s in SCHEDULES for o in OPTIMS] + [
    ("gemma2", "ZBVZeroBubble", "adamw"),
    ("user", "LoopedBFS", "adamw"),
    ("user", "DualPipeV", "adamw"),
]


def _loader():
    ids = torch.cat([zx.batch(s, size=BATCH) for s in range(STEPS)])
    return DataLoader(TensorDataset(ids), batch_size=BATCH)


def _build(name):
    return MODELS[name]().eval()


def _reference(name, opt):
    model = _build(name)
    optim = OPTIMS[opt](model.parameters())
    losses = [ca.train_step(eq.Logits(model), optim, x, x, eq.shifted_ce) for (x,) in _loader()]
    return losses, eq.numpy_params(model, remove_duplicate=False)


def _pipelined(name, schedule, opt):
    model = _build(name)
    pp = ca.pipeline_parallel(microbatches=4, schedule=schedule, stages_per_rank=2)
    plan = ca.compose(pp, ca.parallel_mode([("pipeline", 2), ("data", 2)]))
    applied = plan(model, OPTIMS[opt](model.parameters()), _loader())
    model, optim, data = applied
    losses = [ca.train_step(model, optim, x, x, eq.shifted_ce) for (x,) in data]
    params = eq.numpy_params(model)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params)
    return losses, gathered, plan.explain(applied=applied)


def _mixed():
    """tensor 2 x pipeline 2 (mixed_parallel), Interleaved1F1B at 2 stages per rank: the mean loss per step."""
    model = _build("llama")
    pp = ca.mixed_parallel(schedule="Interleaved1F1B", microbatches=4, stages_per_rank=2)
    plan = ca.compose(pp, ca.parallel_mode([("tensor", 2), ("pipeline", 2)]))
    model, optim, data = plan(model, OPTIMS["sgd"](model.parameters()), _loader())
    return [ca.train_step(model, optim, x, x, eq.shifted_ce) for (x,) in data]


def _world(rank, world):
    mine = {c: _pipelined(*c) for c in CASES}
    mine["mixed"] = (_mixed(),)
    refs = {c: _reference(c[0], c[2]) for c in eq.mine(rank, world, CASES)}
    return mine, refs


@pytest.mark.dist
def test_two_stages_per_rank_equal_to_one_process():
    got = run_world(_world, 4, timeout=1200)
    refs = {k: v for _, r in got for k, v in r.items()}
    bad = {}
    mixed = max(abs(a - b) for a, b in zip(got[0][0]["mixed"][0], refs[("llama", "Interleaved1F1B", "sgd")][0]))
    assert mixed < TOL, mixed
    for case, (ref_losses, ref_params) in refs.items():
        losses, gathered, explain = got[0][0][case]
        assert all(g[0][case][0] == losses for g in got), (case, "ranks report different losses")
        gap = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        held = {n for g in gathered for n in g}
        weight = max(float(abs(p - ref_params[n]).max()) for g in gathered for n, p in g.items())
        if gap > TOL or weight > TOL or not held <= set(ref_params) or len(held) < len(set(ref_params)) // 2:
            bad[case] = (gap, weight, sorted(set(ref_params) - held)[:4])
        placed = "[0, 3]" if case[1] in ("ZBVZeroBubble", "DualPipeV") else "[0, 2]"  # V / loop placement
        assert "2 stages per rank" in explain and f"this rank holds stage(s) {placed}" in explain, explain
    assert not bad, bad

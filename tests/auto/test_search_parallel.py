"""A world-4 study on the built-in GPT explores the parallel degrees (tensor x pipeline x data, and the
micro-batch count with a pipeline), every plan trained through ``train_step``; the plan it chooses
trains one model: ranks hold equal copies of every parameter they share, and together all of them.
"""

import pytest
import torch

import composable_atorch as ca
from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.study import search
from composable_atorch.auto.worker import batches, trial_step
from composable_atorch.auto.workload import GPTTask
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment

from _dist import run_world

#: 4 blocks (a 4-stage pipeline needs them), 4 heads (tensor 4 needs them), tiny otherwise
TINY = GPTTask(seq_len=16, d_model=32, n_layer=4, n_head=4, batch_size=16, limit=128)


def degrees(plan_json: str) -> tuple[int, int]:
    plan = Plan.from_json(plan_json, env=Environment.detect().with_(world_size=4))
    step = next(t for t in plan.requested if t.name == "mixed_parallel")  # expanded: its parts are the steps
    return step.tensor or 1, step.pipeline or 1


def train_and_gather(rank: int, world: int, plan_json: str, steps: int) -> dict:
    import torch.distributed as dist

    workload = TINY.workload()
    model, optim, loader = Plan.from_json(plan_json)(*workload.build())
    data = batches(loader)
    losses = [
        trial_step(model, optim, data, workload.loss_fn, "cpu", criterion=workload.criterion)[0] for _ in range(steps)
    ]
    mine = {}
    for name, p in ca.runtime.optim.named_parameters(model).items():
        mine[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone().numpy()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return {}
    diff = 0.0
    for other in everyone[1:]:
        for k in set(other) & set(mine):
            diff = max(diff, float(abs(torch.as_tensor(other[k]) - torch.as_tensor(mine[k])).max()))
    return {"diff": diff, "held": [sorted(e) for e in everyone], "losses": losses}


@pytest.mark.dist
@pytest.mark.slow
def test_world_4_study_explores_parallel_degrees_and_the_chosen_plan_trains_one_model():
    env = Environment.detect().with_(world_size=4)
    others = tuple(sorted(set(ca.registry()) - {"mixed_parallel"}))
    result = search(
        TINY.workload(),
        # what the plans do is asserted, not how precisely their speed is known: a short measuring cap
        trial=TrialSettings(world_size=4, warmup_steps=1, measure_steps=2, timeout=240, max_measure_s=2.0),
        budget=Budget(n_trials=4),
        space=SpaceOptions(excluded=others, included=("mixed_parallel",)),
        # the preflight (one more spawned process) is asserted in test_auto_preflight / test_search_budget
        study=StudyOptions(seed=0, sampler="random", predict=False, preflight=False),
        env=env,
        progress=False,
    )
    options = result.space.options["mixed_parallel"]
    # every factorization of 4 with model parallelism; a pipeline with 2 micro-batch counts each
    assert len(options) == 8 and sum("pipeline 1 " in label for label in options) == 2
    measured = [(degrees(r.plan_json), r) for r in result.measured]
    failed = [(d, r.reason) for d, r in measured if r.status != "ok"]
    assert failed == [], failed
    assert len(measured) == 4
    assert any(t > 1 for (t, _), _ in measured) and any(p > 1 for (_, p), _ in measured)
    # each sample counted once: the global batch per step, however many tensor / pipeline peers saw it
    assert all(r.result.samples_per_step == TINY.batch_size for _, r in measured)
    assert result.best is not None and result.best_plan is not None
    out = run_world(train_and_gather, 4, result.best_plan.to_json(), 3, timeout=300)[0]
    whole = set(dict(TINY.model().named_parameters()))
    assert set().union(*map(set, out["held"])) == whole, degrees(result.best.plan_json)
    assert out["diff"] == 0.0 and all(loss == loss for loss in out["losses"])

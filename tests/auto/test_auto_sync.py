"""At world >= 2 every plan the search can propose trains one model: ranks end with equal parameters.

The static law (fast): each valid plan of the demo's space at world 2 has a step that owns gradient
sync (compose() adds the data-parallel default where the assignment asks for none). The dynamic law
(one spawned world-2 group, many plans): trained with the trial's own build and step, every rank ends
with the same parameters, gathered whole.
"""

import pytest
import torch

import composable_atorch as ca
from composable_atorch.auto.space import SearchSpace, plan_key
from composable_atorch.auto.worker import batches, trial_step
from composable_atorch.auto.workload import GPTTask
from composable_atorch.cli.demo import DEMO_EXCLUDED, TASK
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment

from _dist import run_world

#: Plans the search proposes that crash on every rank (a failed trial, not a drift), with why. Empty:
#: module_replace + mixed_parallel crashed until the GPT attention took its head size from the
#: (tensor-sharded) projections instead of d_model.
#: mixed_parallel + accumulate with a pipeline degree crashed (the schedule runs the backward itself)
#: until the contracts refused the pair (pipeline.ACCUMULATE_CONFLICT): the space no longer proposes it.
KNOWN_CRASHES: set[tuple[str, ...]] = set()

TINY = GPTTask(seq_len=16, d_model=16, n_layer=2, n_head=2, batch_size=8, limit=64)


def syncs_gradients(plan: Plan) -> bool:
    return any("grad_sync" in t.contract.owns or "grad_sync" in t.contract.roles for t in plan.transforms)


def demo_space(task: GPTTask, world: int = 2) -> SearchSpace:
    with torch.device("meta"):
        model = task.model()
    return SearchSpace.for_model(
        model, world_size=world, batch_size=task.batch_size, excluded=DEMO_EXCLUDED, env=Environment.detect()
    )


def test_every_plan_the_demo_search_can_propose_at_world_2_syncs_gradients():
    valid = demo_space(TASK).enumerate().valid
    assert len(valid) > 10
    lacking = [p.plan.names for p in valid.values() if not syncs_gradients(p.plan)]
    assert lacking == []
    # the plan with no requested transform (the search's baseline) is data parallel, and says why
    baseline = ca.compose(env=Environment.detect().with_(world_size=2))
    assert syncs_gradients(baseline) and not baseline.requested and "ddp" in baseline.names


def covering_plans(space: SearchSpace) -> list[Plan]:
    """Valid plans such that every option of the engine knob meets every option of every other knob."""
    valid = list(space.enumerate().valid.values())
    engine = max(space.kinds, key=lambda k: len(k.split("+")))
    wanted = {
        (lab, knob, other)
        for lab in space.options[engine]
        for knob in space.kinds
        if knob != engine
        for other in space.options[knob]
    }
    chosen: list[Plan] = []
    while wanted:

        def gain(point, wanted=wanted):
            a = dict(point.assignment)
            return {(a[engine], k, a[k]) for k in space.kinds if k != engine} & wanted

        best = max(valid, key=lambda p: len(gain(p)))
        got = gain(best)
        if not got:
            break  # combinations compose() rejects
        wanted -= got
        chosen.append(best.plan)
    return chosen


def _full(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in ca.runtime.optim.named_parameters(model).items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().clone()
    return out


def train_each_plan(rank: int, world: int, plan_jsons: list[str], steps: int) -> list[dict]:
    import torch.distributed as dist

    workload = TINY.workload()
    out = []
    for text in plan_jsons:
        plan = Plan.from_json(text)
        try:
            model, optim, loader = plan(*workload.build())
            data = batches(loader)
            for _ in range(steps):
                trial_step(model, optim, data, workload.loss_fn, "cpu", criterion=workload.criterion)
            mine = _full(model)
        except Exception as exc:  # noqa: BLE001 - a crash is reported with its plan (collectives stay paired:
            # every rank runs the same plan on the same model, so they fail together)
            out.append({"plan": plan.names, "crash": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        everyone = [None] * world
        dist.all_gather_object(everyone, {k: v.numpy() for k, v in mine.items()})
        # every parameter a rank holds (whole: a pipeline stage holds a subset of them) equals every
        # other rank's copy, and together the ranks hold the whole model
        shared = [k for k in mine if any(k in e for e in everyone if e is not everyone[rank])]
        diff = max(
            (float(abs(torch.as_tensor(e[k]) - mine[k]).max()) for e in everyone for k in shared if k in e), default=0.0
        )
        missing = sorted(set(dict(TINY.model().named_parameters())) - set().union(*(set(e) for e in everyone)))
        out.append({"plan": plan.names, "missing": missing, "max_diff": diff})
    return out


@pytest.mark.dist
def test_ranks_end_with_equal_parameters_under_every_proposable_plan_at_world_2():
    space = demo_space(TINY)
    plans = covering_plans(space)
    assert len(plans) >= 8 and len({plan_key(p) for p in plans}) == len(plans)
    results = run_world(train_each_plan, 2, [p.to_json() for p in plans], 2, timeout=900)[0]
    crashed = [(r["plan"], r["crash"]) for r in results if "crash" in r]
    drifted = [
        (r["plan"], r["max_diff"], r["missing"])
        for r in results
        if "crash" not in r and (r["max_diff"] != 0.0 or r["missing"])
    ]
    assert drifted == [], drifted
    unknown = [(names, why) for names, why in crashed if not any(set(k) <= set(names) for k in KNOWN_CRASHES)]
    assert unknown == [], unknown
    assert len(results) == len(plans)


def test_covering_plans_meet_every_engine_with_every_option():
    space = demo_space(TINY)
    plans = covering_plans(space)
    engine = max(space.kinds, key=lambda k: len(k.split("+")))
    keys = {plan_key(p) for p in plans}
    met = {
        (dict(pt.assignment)[engine], knob, dict(pt.assignment)[knob])
        for pt in space.enumerate().valid.values()
        if pt.key in keys
        for knob in space.kinds
        if knob != engine
    }
    for label in space.options[engine]:
        assert any(m[0] == label for m in met), label
    assert all(syncs_gradients(p) for p in plans)

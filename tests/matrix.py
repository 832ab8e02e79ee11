"""The registry-driven transform matrix.

Each family of transforms has a ``cases_<family>.py`` module beside this one with a ``CASES``
dict: registry name -> :class:`Case`. test_matrix.py fails when a registered transform has no
case, and runs every case in each config its class offers (``configs``): a tiny GPT, two training
steps with the shared loop, finite loss, the transform in explain(), JSON round-trip to an equal
plan, parameter names and count kept, each parameter in the optimizer exactly once; and checks
composition is order-independent against every other case (``order_violations``). Cases with
``world > 1`` run together inside one spawned gloo group.
"""

from __future__ import annotations

import glob
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import composable_atorch as ca
from composable_atorch.auto.space import block_classes
from composable_atorch.core.transform import SearchContext
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError

import helpers


def tiny_gpt() -> torch.nn.Module:
    return helpers.tiny_gpt(0)


@dataclass
class Case:
    make: Callable[[], object]  # a Transform (or Plan) under test
    world: int = 1
    #: other transforms it needs to be tried with (e.g. a parallel_mode)
    extra: Callable[[], tuple] = field(default=lambda: ())
    model: Callable[[], torch.nn.Module] = tiny_gpt
    batch: int = 8
    #: parameter names may legitimately change (e.g. a pipeline stage holds only some)
    names_kept: bool = True


def all_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    here = os.path.dirname(__file__)
    for path in sorted(glob.glob(os.path.join(here, "cases_*.py"))):
        module = importlib.import_module(os.path.basename(path)[:-3])
        overlap = set(cases) & set(module.CASES)
        if overlap:
            raise RuntimeError(f"matrix cases defined twice: {sorted(overlap)}")
        cases.update(module.CASES)
    return cases


def configs(name: str, case: Case | None = None) -> list:
    """The case's transform and every other config its class offers the search at the case's world
    (``candidates``): a transform with several configs is checked in each."""
    case = case or all_cases()[name]
    first = case.make()
    cls = ca.registry().get(name)
    if cls is None:
        return [first]
    env = Environment.detect().with_(world_size=case.world)
    context = SearchContext(env=env, block_classes=block_classes(case.model()), batch_size=case.batch)
    out = [first]
    for t in cls.candidates(context):
        if all(t != o for o in out):
            out.append(t)
    return out


def _compose(transform, case: Case):
    try:
        return ca.compose(transform, *case.extra())
    except CompositionError:
        if not case.extra():
            raise
        return ca.compose(transform)  # a candidate that brings its own version of the extra


def run_case(name: str, steps: int = 2, transform=None) -> dict:
    """Apply one config of the case (default: the case's own) to a tiny GPT, train ``steps`` steps
    with the shared loop (helpers.train), and return what the test checks."""
    case = all_cases()[name]
    model = case.model()
    before = [n for n, _ in model.named_parameters()]
    count_before = (len(before), sum(p.numel() for p in model.parameters()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = helpers.text_loader(32, batch=case.batch, limit=64)
    transform = case.make() if transform is None else transform
    plan = _compose(transform, case)
    model, optim, loader = plan(model, optim, loader)
    after = [ca.runtime.optim.canonical_name(n) for n, _ in model.named_parameters()]
    count_after = (len(after), sum(p.numel() for p in model.parameters()))
    held = [id(p) for g in optim.param_groups for p in g["params"]]
    owned = {id(p) for p in model.parameters()}
    # the shared loop uses train_step: the documented call that trains every plan (pipelines too)
    losses = helpers.train(model, optim, loader, steps)
    roundtrip = ca.Plan.from_json(plan.to_json(), env=plan.env)
    return {
        "name": name,
        "config": transform.describe() if hasattr(transform, "describe") else repr(transform),
        "losses": losses,
        "finite": all(math.isfinite(v) for v in losses) and bool(losses),
        "explain": plan.explain(),
        "step_names": plan.names,
        # a transform that stands for several (mixed_parallel) is in the request; its parts are the steps
        "expands": bool(getattr(transform, "expands", False)),
        "requested_names": tuple(t.name for t in plan.requested),
        "roundtrip_equal": roundtrip == plan,
        "names_kept": before == after,
        "count_kept": count_before == count_after,
        "counts": (count_before, count_after),
        "names_required": case.names_kept,
        "optimizer_once": len(held) == len(set(held)) and set(held) == owned,
    }


def run_all_configs(name: str, steps: int = 2) -> list[dict]:
    return [run_case(name, steps, t) for t in configs(name)]


def order_violations(name: str) -> list[str]:
    """The order-independence law for every config of ``name`` against every other case's transform
    (at the larger of their worlds): ``compose(a, b, ...) == compose(..., b, a)``, and where one
    order is rejected the other is rejected with the same error type. Pure compose: no model runs."""
    cases = all_cases()
    case = cases[name]
    bad = []
    for t in configs(name, case):
        for other_name, other in sorted(cases.items()):
            if other_name == name:
                continue
            env = Environment.detect().with_(world_size=max(case.world, other.world))
            items = [t, other.make(), *case.extra(), *other.extra()]
            outcomes = []
            for order in (items, items[::-1], items[1:] + items[:1]):
                try:
                    outcomes.append(ca.compose(*order, env=env))
                except CompositionError as exc:
                    outcomes.append(type(exc))
            first = outcomes[0]
            if any((o != first) if not isinstance(first, type) else (o is not first) for o in outcomes[1:]):
                label = t.describe() if hasattr(t, "describe") else repr(t)
                bad.append(f"{label} with {other_name}: {[getattr(o, 'names', o) for o in outcomes]}")
    return bad


def run_cases_in_group(rank: int, world: int, names: list[str]) -> list[dict]:
    return [r for n in names for r in run_all_configs(n)]

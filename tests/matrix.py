"""The registry-driven transform matrix.

Each family of transforms has a ``cases_<family>.py`` module beside this one with a ``CASES``
dict: registry name -> :class:`Case`. test_matrix.py fails when a registered transform has no
case, and runs every case: a tiny GPT, two training steps, finite loss, the transform in
explain(), JSON round-trip to an equal plan, parameter names kept, each parameter in the
optimizer exactly once. Cases with ``world > 1`` run together inside one spawned gloo group.
"""

from __future__ import annotations

import glob
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2))


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


def run_case(name: str, steps: int = 2) -> dict:
    """Apply the case's plan to a tiny GPT, train ``steps`` steps, and return what the test checks."""
    case = all_cases()[name]
    model = case.model()
    before = [n for n, _ in model.named_parameters()]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TextDataset(32, limit=64), batch_size=case.batch)
    transform = case.make()
    plan = ca.compose(transform, *case.extra())
    model, optim, loader = plan(model, optim, loader)
    after = [ca.runtime.optim.canonical_name(n) for n, _ in model.named_parameters()]
    held = [id(p) for g in optim.param_groups for p in g["params"]]
    owned = {id(p) for p in model.parameters()}
    losses = []
    for i, (x, y) in enumerate(loader):
        if i >= steps * getattr(optim, "accumulation_steps", 1):
            break
        loss = lm_loss(model(x), y)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    roundtrip = ca.Plan.from_json(plan.to_json(), env=plan.env)
    return {
        "name": name,
        "losses": losses,
        "finite": all(math.isfinite(v) for v in losses) and bool(losses),
        "explain": plan.explain(),
        "step_names": plan.names,
        "roundtrip_equal": roundtrip == plan,
        "names_kept": before == after,
        "names_required": case.names_kept,
        "optimizer_once": len(held) == len(set(held)) and set(held) == owned,
    }


def run_cases_in_group(rank: int, world: int, names: list[str]) -> list[dict]:
    return [run_case(n) for n in names]

"""Every zoo architecture (tests/zoo.py) under every single-model transform at world 2, against one process.

Each case trains 3 steps on the same global batches with SGD and with AdamW (a gradient-scale bug
hides under Adam's normalisation, not under SGD), compares the final parameters gathered whole
with one process's (1e-4 fp32, 5e-2 under bf16 autocast) and checks that both ranks end equal. A
transform with no meaning for an architecture must refuse with a typed error whose message says
why (``REFUSED``); anything else fails the test. All cases run in two spawned world-2 groups.

The README's table "which families each transform covers" is this file's ``TRANSFORMS`` x ``zoo.ZOO``
minus ``REFUSED``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import composable_atorch as ca
import zoo
from composable_atorch.errors import ConfigError

from _dist import run_world

STEPS = 3
FP32_TOL, BF16_TOL = 1e-4, 5e-2
OPTIMS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}

#: transform -> (its transforms, whether each rank trains on its half of the global batch)
TRANSFORMS = {
    "ddp": (lambda: (ca.ddp(),), True),
    "fsdp": (lambda: (ca.fsdp(),), True),
    "zero2": (lambda: (ca.zero2(),), True),
    "checkpoint": (lambda: (ca.checkpoint(), ca.ddp()), True),
    "amp": (lambda: (ca.amp("bf16"), ca.ddp()), True),
    "module_replace": (lambda: (ca.module_replace(), ca.ddp()), True),
    "tensor_parallel": (lambda: (ca.tensor_parallel(), ca.parallel_mode([("tensor", 2)])), False),
}

#: (architecture, transform) -> a fragment of the typed refusal's message
REFUSED: dict[tuple[str, str], str] = {}


def _build(name: str):
    """The zoo model without dropout: one process and a world-2 run cannot draw the same masks
    (tensor_parallel's own dropout streams are tested in test_tensor_parallel.py)."""
    model = zoo.build(name)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr, value in list(vars(m).items()):
            if isinstance(value, float) and ("dropout" in attr or "pdrop" in attr):
                setattr(m, attr, 0.0)
    return model


def _full(model) -> dict[str, torch.Tensor]:
    from composable_atorch.runtime.optim import named_parameters
    from composable_atorch.transforms.parallel.tensor import full_weight

    modules = dict(model.named_modules())
    out = {}
    for name, p in named_parameters(model).items():
        mod, _, attr = name.rpartition(".")
        m = modules.get(mod)
        if m is not None and hasattr(m, "_tp_stride_perm"):
            out[name] = full_weight(m, attr).detach().float().clone()
        else:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().float().clone()
    return out


def _train(name, model, optim, batches, part=None):
    for ids in batches:
        ids = ids if part is None else ids[part]
        loss = zoo.zoo_loss(name, model, ids)
        optim.backward(loss) if hasattr(optim, "backward") else loss.backward()
        optim.step()
        optim.zero_grad()
    return model


def _reference(name: str, opt: str) -> dict[str, torch.Tensor]:
    model = _build(name)
    batches = [zoo.batch(name, seed=s) for s in range(STEPS)]
    return _full(_train(name, model, OPTIMS[opt](model.parameters()), batches))


def _case(name: str, transform: str, opt: str):
    """('ok', max gap, rank params) or ('refused', message)."""
    make, split = TRANSFORMS[transform]
    model = _build(name)
    batches = [zoo.batch(name, seed=s) for s in range(STEPS)]
    rank = torch.distributed.get_rank()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optim, _ = ca.compose(*make())(model, OPTIMS[opt](model.parameters()))
            part = slice(2 * rank, 2 * rank + 2) if split else None
            _train(name, model, optim, batches, part)
    except ConfigError as e:
        return ("refused", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - an untyped failure is reported as such, the other cases still run
        return ("error", f"{type(e).__name__}: {str(e)[:400]}")
    return ("ok", {k: v.numpy() for k, v in _full(model).items()})


def _world(rank, world, cases):
    out = {}
    for name, transform, opt in cases:
        out[(name, transform, opt)] = _case(name, transform, opt)
    return out


def _all_cases(transforms):
    return [(n, t, o) for t in transforms for n in zoo.ZOO for o in OPTIMS]


def _check(results, cases):
    failures = []
    refs: dict = {}
    for case in cases:
        name, transform, opt = case
        r0, r1 = results[0][case], results[1][case]
        if "error" in (r0[0], r1[0]):
            failures.append(f"{case}: untyped error: {r0[1] if r0[0] == 'error' else r1[1]}")
            continue
        if r0[0] == "refused":
            want = REFUSED.get((name, transform))
            if want is None or want not in r0[1]:
                failures.append(f"{case}: refused: {r0[1][:300]}")
            continue
        if (name, transform) in REFUSED:
            failures.append(f"{case}: expected a refusal, trained")
        if (name, opt) not in refs:
            refs[(name, opt)] = _reference(name, opt)
        ref = refs[(name, opt)]
        tol = BF16_TOL if transform == "amp" else FP32_TOL
        p0, p1 = r0[1], r1[1]
        if sorted(p0) != sorted(ref):
            failures.append(f"{case}: parameter names differ: {sorted(set(p0) ^ set(ref))[:5]}")
            continue
        gap = max(float((torch.from_numpy(p0[k]) - ref[k]).abs().max()) for k in ref)
        ranks = max(float(abs(p0[k] - p1[k]).max()) for k in ref)
        start = _full(_build(name))
        moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
        if gap > tol or ranks > tol or moved == 0:
            failures.append(f"{case}: gap to one process {gap:.2e}, between ranks {ranks:.2e} (tol {tol})")
    return failures


@pytest.mark.dist
@pytest.mark.parametrize(
    "group", [("ddp", "fsdp", "zero2"), ("checkpoint", "amp", "module_replace", "tensor_parallel")]
)
def test_zoo_matches_one_process(group):
    cases = _all_cases(group)
    results = run_world(_world, 2, cases, timeout=900)
    failures = _check(results, cases)
    assert not failures, "\n".join(failures)

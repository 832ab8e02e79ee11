"""A non-finite loss never reaches the weights silently: amp bf16 and half skip the step by default."""

import pytest
import torch

import composable_atorch as ca
from composable_atorch.errors import ConfigError, NonFiniteError
from composable_atorch.models.gpt import lm_loss

from _dist import run_world
from helpers import triple

PLANS = {
    "amp-bf16": lambda: ca.amp("bf16"),
    "half-bf16": lambda: ca.half("bf16"),
    "half-bf16-master": lambda: ca.half("bf16", master_weights=True),
    "half+amp-bf16": lambda: ca.half("bf16") | ca.amp("bf16"),
}
POISONED = 2  # the step (0-based) whose loss is NaN


def snapshot(model, optim):
    state = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, st in enumerate(optim.optimizer.state.values()):
        state.update({f"s.{i}.{k}": v.detach().clone() for k, v in st.items() if torch.is_tensor(v)})
    return state


def all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def poisoned_run(plan, steps=5, poison_rank=0, optim_cls=torch.optim.AdamW):
    """Per step: (weights and optimizer state after it, step_was_skipped); the loss at POISONED is NaN."""
    model, optim, loader = plan(*triple(optim_cls=optim_cls))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    batches, out = iter(loader), []
    for step in range(steps):
        x, y = next(batches)
        loss = lm_loss(model(x), y)
        if step == POISONED and rank == poison_rank:
            loss = loss * float("nan")
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        out.append((snapshot(model, optim), optim.step_was_skipped))
    return out


def check_skipped_once(run):
    states = [s for s, _ in run]
    assert [skipped for _, skipped in run] == [i == POISONED for i in range(len(run))]
    before, at, after = states[POISONED - 1], states[POISONED], states[POISONED + 1]
    assert before.keys() == at.keys() and all(torch.equal(before[k], at[k]) for k in before)
    assert all(all_finite(s) for s in states)
    assert not torch.equal(at["p.head.weight"], after["p.head.weight"])  # training went on


@pytest.mark.parametrize("name", PLANS)
def test_a_nan_loss_skips_the_step_and_training_goes_on(name):
    check_skipped_once(poisoned_run(PLANS[name]()))


def test_sgd_too_and_the_explanation_says_what_happens():
    check_skipped_once(poisoned_run(ca.amp("bf16"), optim_cls=torch.optim.SGD))
    applied = ca.compose(ca.half("bf16"))(*triple())
    assert "inf/nan gradients is skipped" in ca.compose(ca.half("bf16")).explain(applied=applied)


@pytest.mark.parametrize(
    "plan", [lambda: ca.amp("bf16", nonfinite="raise"), lambda: ca.half("bf16", nonfinite="raise")]
)
def test_raise_stops_before_anything_changes(plan):
    model, optim, loader = plan()(*triple())
    masters = [p for g in optim.param_groups for p in g["params"]]
    x, y = next(iter(loader))
    optim.backward(lm_loss(model(x), y))
    optim.step()
    optim.zero_grad()
    before = snapshot(model, optim)
    optim.backward(lm_loss(model(x), y) * float("inf"))
    with pytest.raises(NonFiniteError, match="step 2.*inf/nan"):
        optim.step()
    after = snapshot(model, optim)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p for g in optim.param_groups for p in g["params"]] == masters


def test_allow_is_the_explicit_opt_out():
    run = poisoned_run(ca.amp("bf16", nonfinite="allow"), steps=POISONED + 1)
    assert not all_finite(run[POISONED][0])
    # ATorch's skip_if_nonfinite=False was its default (every older plan file holds it): not an opt-out
    assert ca.amp("bf16", skip_if_nonfinite=False) == ca.amp("bf16") == ca.amp("bf16", skip_if_nonfinite=True)
    assert ca.amp("bf16").nonfinite == "skip"
    with pytest.raises(ConfigError, match="skip_if_nonfinite"):
        ca.amp("bf16", skip_if_nonfinite=True, nonfinite="allow")
    with pytest.raises(ConfigError, match="nonfinite"):
        ca.half("bf16", nonfinite="ignore")
    with pytest.raises(ConfigError, match="fp16"):
        ca.amp("fp16", nonfinite="allow")


def world2_poisoned(rank, world):
    # rank 0's loss alone is NaN: the all-reduced gradients carry it to every rank, all skip alike
    out = {}
    for name in ("amp-bf16", "half-bf16"):
        run = poisoned_run(ca.ddp() | PLANS[name]())
        check_skipped_once(run)
        out[name] = {k: v.float().numpy() for k, v in run[-1][0].items() if k.startswith("p.")}
    return out


@pytest.mark.dist
def test_world2_every_rank_skips_the_poisoned_step_and_ranks_stay_equal():
    import numpy as np

    a, b = run_world(world2_poisoned, 2)
    for name in a:
        assert all(np.array_equal(a[name][k], b[name][k]) for k in a[name]), name


def test_the_check_is_exact_where_a_sum_overflows_or_cancels():
    """The check sums each gradient first: huge finite gradients whose sum overflows still step, and
    an inf next to a -inf (a nan sum) or a lone nan are still caught."""
    from composable_atorch.transforms.parallel.shared.grads import all_finite as _all_finite

    big = torch.full((4,), 3e38)
    assert _all_finite([big, big.clone()])  # the float32 sum is inf, every element finite
    assert _all_finite([torch.ones(3, dtype=torch.bfloat16), torch.zeros(0)])
    assert not _all_finite([torch.tensor([float("inf"), -float("inf")])])
    assert not _all_finite([torch.ones(3), torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])
    assert _all_finite([])

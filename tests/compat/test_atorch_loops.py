"""ATorch's training loops under every precision plan (issue 9, bug 2).

ATorch's loop is ``loss = result.loss_func(input, output); loss.backward(); optim.step()``, or
``optim.backward(loss)`` when ``args.use_optim_backward``. The facade returns
``optim.loss_wrapper(loss_func)`` as ``result.loss_func`` (ATorch wraps its loss function to scale
the same way), so both loops scale / average the loss where the plan needs it.
"""

import copy

import pytest
import torch

import composable_atorch as ca
from composable_atorch.errors import RequirementError
from composable_atorch.models.gpt import lm_loss
from composable_atorch.runtime.optim import PlanLoss

from helpers import params, train, triple, twins

STEPS = 8
# Measured on this machine over 8 AdamW steps of the tiny GPT, worst relative loss difference to
# float32: fp16 autocast 9e-6, bf16 autocast 8.4e-5 (the same in either loop). Tolerances leave >10x margin.
LOSS_RTOL = {"fp32": 0.0, "fp16": 2e-4, "bf16": 1e-3}

PLANS = {
    # amp disabled (ATorch's "enabled": False) trains exactly as float32
    "fp32": lambda: ca.compose(ca.amp("fp16", enabled=False)),
    "fp16": lambda: ca.compose(ca.amp("fp16")),
    "bf16": lambda: ca.compose(ca.amp("bf16")),
}


def atorch_loss_func(data, output):
    """An ATorch-style loss function: (input, output) -> (loss, extra)."""
    return lm_loss(output, data[1]), {"tokens": data[1].numel()}


def atorch_train(model, optim, loader, steps, *, use_optim_backward, on_grads=None):
    """ATorch's loop with the facade's wrapped loss function; returns per-micro-batch losses."""
    loss_func = optim.loss_wrapper(atorch_loss_func)
    losses, micro = [], getattr(optim, "accumulation_steps", 1)
    it = iter(loader)
    for _ in range(steps * micro):
        data = next(it)
        loss, extra = loss_func(data, model(data[0]))
        assert extra == {"tokens": data[1].numel()}
        if use_optim_backward:
            optim.backward(loss)
        else:
            loss.backward()
        if on_grads is not None:
            on_grads(model)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("use_optim_backward", [False, True], ids=["loss.backward", "optim.backward"])
@pytest.mark.parametrize("precision", list(PLANS))
def test_both_atorch_loops_track_fp32_reference(precision, use_optim_backward):
    a, b = twins()
    ref = train(*a, STEPS, use_optim_backward=False)
    model, optim, loader = PLANS[precision]()(*b)
    got = atorch_train(model, optim, loader, STEPS, use_optim_backward=use_optim_backward)
    assert len(got) == STEPS
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert abs(r - g) <= LOSS_RTOL[precision] * abs(r), f"step {step}: fp32 {r} vs {precision} {g}"
    if precision == "fp32":
        ref_p, got_p = params(a[0]), params(model)
        assert all(torch.equal(ref_p[n], got_p[n]) for n in ref_p)  # bitwise: nothing was cast
    else:
        assert ref != got  # autocast really ran
    assert optim.step_was_skipped is False
    assert (optim.grad_scaler is not None) == (precision == "fp16")


@pytest.mark.parametrize("use_optim_backward", [False, True], ids=["loss.backward", "optim.backward"])
def test_accumulation_with_the_wrapped_loss_equals_one_big_batch(use_optim_backward):
    # SGD, not Adam: see test_loop.test_accumulate_equals_one_step_on_the_whole_batch
    a = triple(optim_cls=torch.optim.SGD, lr=0.5)
    b = triple(copy.deepcopy(a[0]), optim_cls=torch.optim.SGD, lr=0.5)
    train(*a, 3, use_optim_backward=False)
    model, optim, loader = ca.accumulate(2)(*b)
    atorch_train(model, optim, loader, 3, use_optim_backward=use_optim_backward)
    ref, got = params(a[0]), params(model)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def _poison(model):
    next(model.parameters()).grad[0] = float("inf")


@pytest.mark.parametrize("use_optim_backward", [False, True], ids=["loss.backward", "optim.backward"])
@pytest.mark.parametrize("amp_args", [("fp16", False), ("bf16", True)], ids=["fp16-scaler", "bf16-skip"])
def test_poisoned_step_is_skipped_in_both_loops(amp_args, use_optim_backward):
    dtype, skip = amp_args
    model, optim, loader = ca.amp(dtype, skip_if_nonfinite=skip)(*triple())
    before = params(model)
    atorch_train(model, optim, loader, 1, use_optim_backward=use_optim_backward, on_grads=_poison)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert optim.step_was_skipped is True
    atorch_train(model, optim, loader, 1, use_optim_backward=use_optim_backward)
    assert optim.step_was_skipped is False
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("plan", [lambda: ca.amp("fp16"), lambda: ca.accumulate(2)], ids=["fp16", "accumulate"])
def test_unwrapped_plain_backward_fails_loudly_where_the_loss_needs_the_plan(plan):
    model, optim, loader = plan()(*triple())
    before = params(model)
    it = iter(loader)
    with pytest.raises(RequirementError, match=r"optim\.backward\(loss\).*optim\.wrap_loss"):
        for _ in range(optim.accumulation_steps):
            x, y = next(it)
            lm_loss(model(x), y).backward()  # not wrapped: would step unscaled / k times too large
            optim.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_unwrapped_plain_backward_still_trains_where_nothing_needs_the_loss():
    model, optim, loader = ca.compose(ca.amp("bf16"), ca.clip_grad(1.0))(*triple())
    assert optim.needs_loss_hook is False
    before = params(model)
    train(model, optim, loader, 1, use_optim_backward=False)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_wrapped_loss_is_a_plain_tensor_elsewhere_and_scale_loss_scales():
    model, optim, loader = ca.amp("fp16")(*triple())
    x, y = next(iter(loader))
    loss = optim.wrap_loss(lm_loss(model(x), y))
    assert isinstance(loss, PlanLoss) and type(loss * 2) is torch.Tensor and type(loss.detach()) is torch.Tensor
    assert optim.loss_wrapper(None) is None
    assert optim.wrap_loss([loss, 3])[1] == 3
    torch.testing.assert_close(optim.scale_loss(loss), loss.detach() * optim.grad_scaler.get_scale())
    assert optim.optimizer.__class__ is torch.optim.AdamW


def test_manual_unscale_then_clip_matches_the_fp32_reference_clipped():
    # SGD: Adam's first step is ~lr * sign(grad), which flips on near-zero gradients under fp16
    ref_model, ref_opt, _ = triple(optim_cls=torch.optim.SGD, lr=1.0)
    model, optim, loader = ca.amp("fp16")(*triple(copy.deepcopy(ref_model), optim_cls=torch.optim.SGD, lr=1.0))
    x, y = next(iter(loader))
    lm_loss(ref_model(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    ref_opt.step()
    loss = optim.loss_wrapper(atorch_loss_func)((x, y), model(x))[0]
    loss.backward()
    optim.unscale_()  # ATorch's AmpNativeOptimizer.unscale_(), before clipping by hand
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optim.step()  # does not unscale a second time
    torch.testing.assert_close(norm, ref_norm, rtol=1e-3, atol=0)
    assert norm > 0.05 and not optim.step_was_skipped
    ref_p = params(ref_model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_p[n], rtol=0, atol=2e-5, msg=n)

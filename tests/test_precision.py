"""amp and half against a plain float32 reference."""

import pytest
import torch

import composable_atorch as ca
from composable_atorch.models.gpt import lm_loss
from composable_atorch.transforms.precision import GradScalerHook, NonfiniteSkipHook

from helpers import gpt, train, triple, twins

# Measured on this machine: over 20 AdamW steps of the tiny GPT, bf16 autocast losses stay within
# 5e-5 relative of float32 (3e-4 absolute). The stated tolerance leaves a 20x margin.
AMP_BF16_LOSS_RTOL = 1e-3


def test_amp_bf16_tracks_fp32_within_stated_tolerance_over_20_steps():
    a, b = twins()
    ref = train(*a, 20, use_optim_backward=False)
    model, optim, loader = ca.amp("bf16")(*b)
    got = train(model, optim, loader, 20)
    assert len(got) == 20
    for step, (r, g) in enumerate(zip(ref, got)):
        assert abs(r - g) <= AMP_BF16_LOSS_RTOL * abs(r), f"step {step}: fp32 {r} vs bf16 {g}"
    assert ref != got  # autocast really ran in bf16: not bitwise equal to fp32


def test_amp_autocasts_inside_and_returns_float32():
    model, optim, loader = ca.amp("bf16")(*triple())
    seen = []
    model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, _ = next(iter(loader))
    out = model(x)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32


def test_amp_applies_once_per_module():
    model, optim, loader = triple()
    plan = ca.compose(ca.amp("bf16"))
    model, optim, loader = plan(model, optim, loader)
    forward = model.forward
    plan(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    assert model.forward is forward


def _poison_first_grad(model):
    first = next(model.parameters())
    first.grad[0] = float("inf")


@pytest.mark.parametrize("amp_cfg, hook_type", [(("fp16",), GradScalerHook), (("bf16", True), NonfiniteSkipHook)])
def test_nonfinite_step_is_skipped_and_training_recovers(amp_cfg, hook_type):
    dtype, *skip = amp_cfg
    model, optim, loader = ca.amp(dtype, skip_if_nonfinite=bool(skip))(*triple())
    (hook,) = list(optim.hook(hook_type))
    batches = iter(loader)
    # step 1: gradients poisoned with inf -> no parameter may change
    x, y = next(batches)
    optim.backward(lm_loss(model(x), y))
    _poison_first_grad(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim.step()
    optim.zero_grad()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert hook.skipped_steps == 1
    # step 2: clean gradients -> the step happens, everything stays finite
    x, y = next(batches)
    optim.backward(lm_loss(model(x), y))
    optim.step()
    optim.zero_grad()
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
    assert len(changed) == len(before)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert hook.skipped_steps == 1


def test_fp16_scaler_scales_the_loss():
    model, optim, loader = ca.amp("fp16")(*triple())
    (hook,) = list(optim.hook(GradScalerHook))
    x, y = next(iter(loader))
    loss = lm_loss(model(x), y)
    assert torch.allclose(hook.scale_loss(loss), loss * hook.scaler.get_scale())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_trains_in_dtype_and_keeps_parameters(dtype):
    # SGD: Adam's eps=1e-8 underflows in pure fp16 (CPU_FACTS: fp16 Adam went NaN by step 8)
    model, optim, loader = triple(optim_cls=torch.optim.SGD, lr=0.1)
    ids = [id(p) for p in model.parameters()]
    model, optim, loader = ca.half(dtype)(model, optim, loader)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert all(p.dtype == want for p in model.parameters())
    assert [id(p) for p in model.parameters()] == ids  # cast in place: the optimizer keeps them
    x, _ = next(iter(loader))
    assert model(x).dtype == torch.float32
    losses = train(model, optim, loader, 3)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_half_bf16_close_to_fp32_on_first_forward():
    ref = gpt()
    model = ca.half("bf16")(gpt())[0]
    x = torch.randint(0, 256, (2, 32))
    # bf16 has 8 bits of mantissa: first-step logits agree to a few hundredths
    torch.testing.assert_close(model(x), ref(x), atol=0.1, rtol=0.05)

"""accumulate, clip_grad, the optimizer rebuilt by name, and the one-loop optimizer API."""

import copy
from dataclasses import dataclass

import pytest
import torch

import composable_atorch as ca
from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import Transform, registry, registry_scope
from composable_atorch.errors import ConfigError, ParameterMappingError

from helpers import gpt, params, train, triple, twins


def test_accumulate_equals_one_step_on_the_whole_batch():
    # SGD, not Adam: k.bias has an exactly-zero true gradient (softmax ignores a constant shift of
    # the keys), and Adam would normalise the ~1e-10 rounding noise in it into full-size steps.
    a = triple(optim_cls=torch.optim.SGD, lr=0.5)
    b = triple(copy.deepcopy(a[0]), optim_cls=torch.optim.SGD, lr=0.5)
    train(*a, 4, use_optim_backward=False)  # batch 8, 4 steps
    model, optim, loader = ca.accumulate(2)(*b)
    assert loader.batch_size == 4 and optim.accumulation_steps == 2
    losses = train(model, optim, loader, 4)  # 8 micro-batches of 4 -> 4 steps
    assert len(losses) == 8
    ref, got = params(a[0]), params(model)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)
    assert any(not torch.equal(got[n], params(gpt())[n]) for n in got)  # it trained


def test_accumulate_steps_only_on_boundaries_and_keeps_grads_between():
    model, optim, loader = ca.accumulate(3)(*triple(batch=12))
    it = iter(loader)
    start = params(model)
    for micro in range(3):
        x, y = next(it)
        optim.backward(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        assert optim.is_boundary == (micro == 2)
        optim.step()
        optim.zero_grad()
        if micro < 2:
            assert all(torch.equal(start[n], p) for n, p in model.named_parameters())
            assert all(p.grad is not None for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(start[n], p) for n, p in model.named_parameters())


def test_accumulate_batch_must_divide():
    with pytest.raises(ConfigError, match="divisor of the loader's batch size 8"):
        ca.accumulate(3)(*triple(batch=8))


def test_clip_grad_matches_manual_clipping():
    (m1, o1, l1), b = twins()
    model, optim, loader = ca.clip_grad(0.05)(*b)
    x, y = next(iter(l1))
    for m, backward in ((m1, lambda loss: loss.backward()), (model, optim.backward)):
        backward(torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()))
    norm = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
    assert norm > 0.05  # clipping really bites at this threshold
    o1.step()
    optim.step()
    (hook,) = list(optim.hook(ca.transforms.loop.ClipHook))
    torch.testing.assert_close(hook.last_norm, norm)
    for (n, p), q in zip(m1.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


# -- optimizer rebuilt by name -------------------------------------------------------------------


# toy transforms registered only for this module's definitions: nothing leaks into the registry
with registry_scope():

    @dataclass(frozen=True)
    class ToyReplaceParams(Transform):
        """Returns a deep copy of the model: every parameter object is new, names are the same."""

        name = "toy_replace"
        contract = Contract(stage=Stage.MODULE_REWRITE)

        def apply(self, state, ctx):
            state.model = copy.deepcopy(state.model)
            return state

    @dataclass(frozen=True)
    class ToyDropParam(Transform):
        name = "toy_drop"
        contract = Contract(stage=Stage.MODULE_REWRITE)

        def apply(self, state, ctx):
            state.model = copy.deepcopy(state.model)
            state.model.head.weight = None
            return state


def test_toys_are_not_left_registered():
    """The toys above were defined in a registry_scope: the global registry never keeps them."""
    assert "toy_replace" not in registry() and "toy_drop" not in registry()


def test_optimizer_rebuilt_by_name_keeps_groups_and_hyperparameters():
    model = gpt()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}],
        lr=1e-3,
        betas=(0.8, 0.9),
    )
    new_model, new_optim, _ = ToyReplaceParams()(model, optim)
    assert isinstance(new_optim.optimizer, torch.optim.AdamW) and new_optim.optimizer is not optim
    assert len(new_optim.param_groups) == 2
    for old_g, new_g in zip(optim.param_groups, new_optim.param_groups):
        assert {k: v for k, v in old_g.items() if k != "params"} == {k: v for k, v in new_g.items() if k != "params"}
    new_by_id = {id(p): n for n, p in new_model.named_parameters()}
    old_by_id = {id(p): n for n, p in model.named_parameters()}
    for old_g, new_g in zip(optim.param_groups, new_optim.param_groups):
        assert [new_by_id[id(p)] for p in new_g["params"]] == [old_by_id[id(p)] for p in old_g["params"]]
    held = [id(p) for g in new_optim.param_groups for p in g["params"]]
    assert len(held) == len(set(held)) == len(list(new_model.parameters()))


def test_lost_parameter_is_an_error():
    model, optim, _ = triple()
    with pytest.raises(ParameterMappingError, match="head.weight"):
        ToyDropParam()(model, optim)


def test_foreign_tensor_in_optimizer_is_an_error():
    model = gpt()
    stray = torch.nn.Parameter(torch.zeros(3))
    optim = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(ParameterMappingError, match="does not own"):
        ca.amp("bf16")(model, optim)


def test_partial_optimizer_keeps_frozen_parameters_out():
    model = gpt()
    trainable = [p for n, p in model.named_parameters() if n.startswith("head")]
    optim = torch.optim.SGD(trainable, lr=0.1)
    _, new_optim, _ = ToyReplaceParams()(model, optim)
    assert sum(len(g["params"]) for g in new_optim.param_groups) == len(trainable)


def test_plain_backward_works_without_scaling_and_lr_scheduler_accepts_plan_optimizer():
    a, b = twins()
    ref = train(*a, 3, use_optim_backward=False)
    model, optim, loader = ca.compose(ca.clip_grad(100.0), ca.amp("bf16"))(*b)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    got = train(model, optim, loader, 1, use_optim_backward=False)
    sched.step()
    assert optim.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert abs(got[0] - ref[0]) < 1e-2


def test_plan_optimizer_state_dict_roundtrip():
    model, optim, loader = ca.compose(ca.amp("fp16"), ca.accumulate(2))(*triple())
    train(model, optim, loader, 2)
    state = optim.state_dict()
    model2, optim2, _ = ca.compose(ca.amp("fp16"), ca.accumulate(2))(*triple())
    optim2.load_state_dict(state)
    (h1,) = list(optim.hook(ca.transforms.precision.GradScalerHook))
    (h2,) = list(optim2.hook(ca.transforms.precision.GradScalerHook))
    assert h1.scaler.get_scale() == h2.scaler.get_scale()
    assert optim2.optimizer.state_dict()["state"].keys() == optim.optimizer.state_dict()["state"].keys()

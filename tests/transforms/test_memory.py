"""checkpoint: bitwise-equal gradients, names kept, matching rules, seed forms."""

import copy

import pytest
import torch

import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.models import MLP, Block
from composable_atorch.models.gpt import lm_loss

from helpers import gpt


def _grads(model):
    torch.manual_seed(1)
    x = torch.randint(0, 256, (4, 32))
    y = torch.randint(0, 256, (4, 32))
    lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: ca.checkpoint(Block),
        lambda: ca.checkpoint("Block"),
        lambda: ca.checkpoint(Block, reentrant=True),
        lambda: ca.checkpoint({"wrap_class": (Block,), "no_reentrant": False}),
        lambda: ca.checkpoint("blocks.0", MLP),
    ],
)
def test_checkpointed_gradients_bitwise_equal_and_names_kept(make):
    ref = _grads(gpt())
    model = gpt()
    names = [n for n, _ in model.named_parameters()]
    model = make()(model)[0]
    assert [n for n, _ in model.named_parameters()] == names
    got = _grads(model)
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.equal(ref[n], got[n]), n


def test_checkpoint_really_recomputes():
    calls = []
    model = gpt()
    mlp = model.blocks[0].mlp
    inner = mlp.forward

    def counting_forward(*args):  # module hooks do not fire during recomputation; forward does
        calls.append(1)
        return inner(*args)

    mlp.forward = counting_forward
    ca.checkpoint(Block)(model)
    x = torch.randint(0, 256, (2, 32))
    lm_loss(model(x), x).backward()
    assert len(calls) == 2  # forward, then recomputation in backward


def test_seed_dict_form_maps_no_reentrant():
    assert ca.checkpoint({"wrap_class": (Block,), "no_reentrant": False}) == ca.checkpoint(Block, reentrant=True)
    assert ca.checkpoint({"wrap_class": Block}) == ca.checkpoint(Block)


def test_outermost_match_only():
    model = gpt()
    ca.compose(ca.checkpoint(Block, MLP))(model)
    plan = ca.compose(ca.checkpoint(Block, MLP))
    applied = plan(gpt())
    assert "2 module(s) checkpointed" in plan.explain(applied)  # what a step did is in the applied state


def test_no_match_is_a_config_error_before_changes():
    model = gpt()
    with pytest.raises(ConfigError, match="none matched"):
        ca.checkpoint("NoSuchBlock")(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_copy_of_a_checkpointed_model_trains_its_own_weights(reentrant):
    """copy.deepcopy (ddp's probe replica, users' EMA copies) gives a model whose checkpointed blocks
    run the copy's weights: the reentrant wrapper once closed over the original block."""
    model = gpt()
    ca.checkpoint(Block, reentrant=reentrant)(model)
    twin = copy.deepcopy(model)
    x = torch.randint(0, 256, (2, 32))
    lm_loss(twin(x), x).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.parameters())
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.zero_()
    assert not torch.equal(twin(x), model(x))

"""checkpoint on models as users build them (issue 27): key/value caches left on (the default), sliding
window / hybrid attention, latent attention, state-space caches, encoder-decoder caches and a
user-given prefix cache. The recompute must see exactly what the forward saw: gradients bitwise
equal to the uncheckpointed model's."""

import copy

import pytest
import torch

import composable_atorch as ca
import zoo

tf = pytest.importorskip("transformers")

FAMILIES = ["gemma2", "mixtral", "t5", "gpt_oss", "deepseek_v3", "qwen2_moe", "mamba", "llama"]


def _block(model):
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return type(max(lists, key=len)[0])


def _grads(name, model):
    model.train()
    torch.manual_seed(1)  # dropout left on: the checkpoint replays the forward's random stream
    zoo.zoo_loss(name, model, zoo.batch(name)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_with_default_caches_equals_no_checkpoint(name, reentrant):
    """The model builds its own cache in every training forward (use_cache on): it used to be kept,
    and the recompute appended the keys again (T5, Gemma 2: a shape error in backward)."""
    ref_model = zoo.build(name)
    assert getattr(ref_model.config, "use_cache", True), "the config's default is kept"
    model = copy.deepcopy(ref_model)
    ref = _grads(name, ref_model)
    plan = ca.compose(ca.checkpoint(_block(model), reentrant=reentrant))
    applied = plan(model)
    assert "key/value cache: dropped in training while empty" in plan.explain(applied)
    got = _grads(name, model)
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.equal(ref[n], got[n]), n


def _prefix_cache(model, prefix):
    with torch.no_grad():
        return model(input_ids=prefix, use_cache=True).past_key_values


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_cache_holding_a_prefix_is_read_once_and_not_dropped(reentrant):
    """A cache that already holds tokens is read by the forward: dropping it (as Hugging Face's
    own gradient checkpointing does) would change the loss; keeping it under checkpointing would
    append the keys again in the recompute. That call runs without checkpointing: exact."""
    ref_model = zoo.build("llama")
    model = copy.deepcopy(ref_model)
    ids, prefix = zoo.batch("llama"), zoo.batch("llama", seed=1)[:, :5]

    def grads(m, cache):
        m.train()
        out = m(input_ids=ids, labels=ids, past_key_values=cache)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in m.named_parameters()}

    ref_out, ref = grads(ref_model, _prefix_cache(ref_model, prefix))
    layer = _block(model)
    ca.checkpoint(layer, reentrant=reentrant)(model)
    cache = _prefix_cache(model, prefix)
    calls = []
    for block in model.modules():
        if isinstance(block, layer):
            inner = block.mlp.forward
            block.mlp.forward = lambda *a, _inner=inner: calls.append(1) or _inner(*a)
    out, got = grads(model, cache)
    assert torch.equal(ref_out.loss, out.loss)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    assert len(calls) == 2, "each block ran once: no recompute reads the appended cache"
    assert out.past_key_values.get_seq_length() == 5 + zoo.SEQ, "the prefix's keys and the batch's, once"
    calls.clear()
    model.zero_grad()
    zoo.zoo_loss("llama", model, ids).backward()  # no prefix: checkpointed again
    assert len(calls) == 4

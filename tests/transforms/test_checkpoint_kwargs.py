"""checkpoint with blocks called with keyword arguments (issue 9, bug 3), and ATorch's config keys."""

import pytest
import torch

import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.models import Block
from composable_atorch.models.gpt import lm_loss
from zoo.configs import gpt2_config, llama_config

from helpers import gpt

tf = pytest.importorskip("transformers")


_ZERO_TOKENS = {"bos_token_id": 0, "eos_token_id": 0}


def hf_gpt2(use_cache=False):
    torch.manual_seed(0)
    drops = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    cfg = gpt2_config(use_cache=use_cache, **_ZERO_TOKENS, **drops)
    return tf.GPT2LMHeadModel(cfg), tf.models.gpt2.modeling_gpt2.GPT2Block


def hf_llama(use_cache=False):
    torch.manual_seed(0)
    cfg = llama_config(max_position_embeddings=64, use_cache=use_cache, **_ZERO_TOKENS)
    return tf.LlamaForCausalLM(cfg), tf.models.llama.modeling_llama.LlamaDecoderLayer


def hf_grads(model):
    torch.manual_seed(1)
    x = torch.randint(0, 128, (2, 16))
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # padding: the mask really reaches the blocks as a keyword argument
    model.train()
    model(input_ids=x, labels=x, attention_mask=mask).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_hf_decoder_layers_checkpoint_with_kwargs_bitwise_equal(make, reentrant):
    ref_model, layer = make()
    ref = hf_grads(ref_model)
    model, layer = make()
    names = [n for n, _ in model.named_parameters()]
    calls = []
    first = next(m for m in model.modules() if isinstance(m, layer))
    first.register_forward_pre_hook(lambda m, args, kwargs: calls.append(sorted(kwargs)), with_kwargs=True)
    model = ca.checkpoint({"wrap_class": layer, "no_reentrant": not reentrant})(model)[0]
    assert [n for n, _ in model.named_parameters()] == names
    got = hf_grads(model)
    assert calls and calls[0], "the decoder layer is called with keyword arguments"
    assert ref.keys() == got.keys() and len(ref) == len(names)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n


def cached_tokens(out) -> int:
    """Key/value entries the model's returned cache holds (summed over layers)."""
    cache = out.past_key_values
    if cache is None:
        return 0
    return sum(0 if layer.keys is None else layer.keys.shape[-2] for layer in cache.layers)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_checkpointed_hf_layers_keep_no_kv_cache_in_training(make, reentrant):
    """A config with use_cache=True (Llama-2's, GPT-2's): each layer's recompute used to append its
    keys and values to the cache again, holding them twice over through the backward. Training
    now runs the checkpointed layers without the cache (as HF's own gradient checkpointing);
    gradients equal the uncheckpointed model's, and eval mode keeps the cache."""
    ref_model, layer = make(use_cache=True)
    ref = hf_grads(ref_model)
    model, layer = make(use_cache=True)
    plan = ca.compose(ca.checkpoint(layer, reentrant=reentrant))
    applied = plan(model)
    model = applied[0]
    assert "key/value cache: dropped in training" in plan.explain(applied)
    x = torch.randint(0, 128, (2, 16))
    model.train()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    assert cached_tokens(out) == 0, "no keys/values kept (nor appended again by the recompute) in training"
    model.zero_grad(set_to_none=True)
    got = hf_grads(model)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    model.eval()
    with torch.no_grad():
        assert cached_tokens(model(input_ids=x)) == 2 * 16, "eval mode keeps the cache: one entry per token per layer"


class KwBlock(torch.nn.Module):
    """A block whose keyword argument is a tensor that needs a gradient, plus a non-tensor one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x, *, gate, scale=1.0):
        self.calls += 1
        return torch.tanh(self.lin(x) * gate) * scale


class KwNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.blocks = torch.nn.ModuleList([KwBlock() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x, gate=self.gate, scale=0.5)
        return x.sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_keyword_tensor_gradients_flow_through_reentrant_checkpoint(reentrant):
    torch.manual_seed(0)
    ref = KwNet()
    model = KwNet()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    ref(x).backward()
    ref_x = x.grad.clone()
    x.grad = None
    ca.checkpoint(KwBlock, reentrant=reentrant)(model)
    model(x).backward()
    assert torch.equal(x.grad, ref_x)
    for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n  # gate: only reachable through the keyword argument
    assert [b.calls for b in model.blocks] == [2, 2, 2]  # forward, then recomputation


def _recompute_counts(model):
    counts = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        inner = block.mlp.forward

        def counting(*args, _i=i, _inner=inner):
            counts[_i] += 1
            return _inner(*args)

        block.mlp.forward = counting
    return counts


@pytest.mark.parametrize("reentrant", [False, True])
def test_max_checkpoint_module_num_checkpoints_only_the_first_n(reentrant):
    model = gpt()
    counts = _recompute_counts(model)
    plan = ca.compose(
        ca.checkpoint({"wrap_class": (Block,), "max_checkpoint_module_num": 1, "no_reentrant": not reentrant})
    )
    applied = plan(model)
    x = torch.randint(0, 256, (2, 32))
    lm_loss(model(x), x).backward()
    assert counts == [2, 1]
    assert "first 1 only" in plan.explain()
    assert "1 of 2 matching modules" in plan.explain(applied)
    assert ca.checkpoint({"wrap_class": Block, "max_checkpoint_module_num": 0})(gpt()) is not None


def test_inert_atorch_keys_are_accepted_and_explained():
    offload = {"offload_args": [], "num_layers": 2}
    t = ca.checkpoint({"wrap_class": Block, "use_te_impl": True, "selective_offload": offload})
    assert t == ca.checkpoint(
        {"wrap_class": Block, "use_te_impl": True, "selective_offload": {"offload_args": [1], "num_layers": 1}}
    )
    assert t.reentrant is False  # selective offload uses the non-reentrant checkpoint, as in ATorch
    plan = ca.compose(t)
    text = plan.explain()
    assert "use_te_impl: no effect" in text and "transformer-engine" in text
    assert "selective_offload: no effect on a CPU" in text
    assert ca.compose(ca.checkpoint({"wrap_class": Block, "use_te_impl": False})) == ca.compose(ca.checkpoint(Block))
    assert ca.Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"wrap_class": Block, "no_such_key": 1}, "no_such_key"),
        ({"wrap_class": Block, "max_checkpoint_module_num": -1}, "max_checkpoint_module_num"),
        ({"wrap_class": Block, "selective_offload": {"num_layers": 2}}, "offload_args"),
        (
            {"wrap_class": Block, "selective_offload": {"offload_args": [], "num_layers": 2}, "no_reentrant": False},
            "no_reentrant",
        ),
        ({"no_reentrant": True}, "wrap_class"),
    ],
)
def test_bad_atorch_checkpoint_config_is_a_config_error(cfg, match):
    with pytest.raises(ConfigError, match=match):
        ca.checkpoint(cfg)

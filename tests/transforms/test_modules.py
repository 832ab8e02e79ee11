"""module_replace: fused attention for the built-in GPT and transformers models, user pairs, dtype filter.

Tolerances (measured on this CPU, float32): the built-in GPT's SDPA attention differs from the
naive one by < 1e-6 in logits and gradients; transformers' eager -> sdpa switch differs by
< 1e-6 in outputs (GPT2, Llama, BERT, CLIP text). The tests allow 1e-5.
"""

import copy

import pytest
import torch
from torch import nn

import composable_atorch as ca
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import CausalSelfAttention, FlashCausalSelfAttention, SDPACausalSelfAttention, lm_loss
from composable_atorch.transforms import modules
from zoo.configs import cfg, gpt2_config, llama_config, shape

TOL = 1e-5


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2))


def grads_of(model, x):
    model.zero_grad()
    logits = model(x)
    lm_loss(logits, x).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_builtin_gpt_sdpa_matches_naive_attention():
    naive = tiny_gpt()
    model = copy.deepcopy(naive)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = ca.compose(ca.module_replace())
    applied = plan(model, optim)
    fused, optim, _ = applied
    assert [type(b.attn) for b in fused.blocks] == [SDPACausalSelfAttention] * 2
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in naive.named_parameters()]
    assert {id(p) for g in optim.param_groups for p in g["params"]} == {id(p) for p in fused.parameters()}
    x = torch.randint(0, 256, (4, 32))
    ref_logits, ref_grads = grads_of(naive, x)
    logits, grads = grads_of(fused, x)
    torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    text = plan.explain(applied=applied)
    assert "gpt_sdpa: 2 x CausalSelfAttention -> SDPACausalSelfAttention" in text
    assert "gpt_flash_attn: not used, needs the package 'flash_attn'" in text
    assert "left alone: torch's LayerNorm" in text


def test_dropout_is_kept_in_training_and_off_in_eval():
    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=1, n_head=2, dropout=0.5))
    model, _, _ = ca.module_replace()(model)
    x = torch.randint(0, 256, (2, 16))
    model.eval()
    torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)
    model.train()
    assert not torch.equal(model(x), model(x))


# -- transformers models built from a config (no download) ---------------------------------------

try:
    import transformers
except ImportError:  # the [hf] extra is not installed: the built-in GPT tests still run
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

_ZERO_TOKENS = {"bos_token_id": 0, "eos_token_id": 0}
#: eager attention, no dropout, 32 positions; special tokens at 0 where the family reads none
_EAGER = {"attn_implementation": "eager", "max_position_embeddings": 32}
_NO_DROP = {"hidden_dropout_prob": 0, "attention_probs_dropout_prob": 0}
HF_MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        gpt2_config(n_positions=32, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **_ZERO_TOKENS, **_EAGER)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(llama_config(**_ZERO_TOKENS, pad_token_id=0, **_EAGER)),
    "bert": lambda: transformers.BertModel(cfg("BertConfig", **shape(32, num_attention_heads=2), **_NO_DROP, **_EAGER)),
    "clip_text": lambda: transformers.CLIPTextModel(
        cfg("CLIPTextConfig", **shape(32, num_attention_heads=2), **_EAGER)
    ),
}


def hf_model(kind):
    torch.manual_seed(0)
    return HF_MODELS[kind]()


def main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@needs_hf
@pytest.mark.parametrize("kind", sorted(HF_MODELS))
def test_transformers_attention_switches_to_sdpa_within_tolerance(kind):
    eager = hf_model(kind)
    assert eager.config._attn_implementation == "eager"
    model = copy.deepcopy(eager)
    plan = ca.compose(ca.module_replace())
    applied = plan(model)
    model, _, _ = applied
    assert model.config._attn_implementation == "sdpa"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
    x = torch.randint(3, 128, (2, 16))
    torch.testing.assert_close(main_output(model(x)), main_output(eager(x)), atol=TOL, rtol=0)
    assert f"hf_sdpa: {type(model).__name__} attention eager -> sdpa via set_attn_implementation" in plan.explain(
        applied=applied
    )


@needs_hf
def test_transformers_default_sdpa_is_left_alone_and_said():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config(layers=1, n_positions=32, n_head=2, **_ZERO_TOKENS))
    plan = ca.compose(ca.module_replace())
    applied = plan(model)
    assert "already uses sdpa attention (transformers' default), left alone" in plan.explain(applied=applied)


def train(model, plan, steps, x):
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if plan is not None:
        model, optim, _ = plan(model, optim)
    losses = [model.config._attn_implementation]
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@needs_hf
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_trains_after_module_replace_like_eager(kind):
    x = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    ref_impl, *ref = train(hf_model(kind), None, 8, x)
    impl, *got = train(hf_model(kind), ca.compose(ca.module_replace()), 8, x)
    assert (ref_impl, impl) == ("eager", "sdpa")
    assert got[-1] < got[0] - 0.5, got  # it learns the fixed batch
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)


@needs_hf
def test_llama_rmsnorm_pair_is_cuda_only_and_its_target_matches():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    pair = modules.replace_pairs()["llama_rmsnorm_fused"]
    assert pair.source_class() is LlamaRMSNorm
    assert pair.needs(Environment()) is not None
    assert pair.needs(Environment(device="cuda", compute_capability=(8, 0))) is None
    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fused = copy.deepcopy(norm)
    fused.__class__ = pair.target_class(LlamaRMSNorm)
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(fused(x), norm(x), atol=1e-6, rtol=0)
    plan = ca.compose(ca.module_replace())
    applied = plan(hf_model("llama"))
    assert (
        "llama_rmsnorm_fused: not used, needs a cuda device (this environment is cpu), for torch's fused rms_norm"
        in plan.explain(applied=applied)
    )


# -- pairs, dtype filter, errors -----------------------------------------------------------------


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.w


class FastScale(Scale):
    """A plain subclass: swapped in place."""

    def forward(self, x):
        return torch.mul(x, self.w)


class BuiltScale(nn.Module):
    """Built from the source module (ATorch's convention), sharing its parameter."""

    def __init__(self, source):
        super().__init__()
        self.w = source.w

    def forward(self, x):
        return x * self.w


class RenamingScale(nn.Module):
    def __init__(self, source):
        super().__init__()
        self.weight = source.w

    def forward(self, x):
        return x * self.weight


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scale()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.scale(x))


modules.register_replace_pair("test_fast_scale_bf16", Scale, FastScale, supported_dtypes={torch.bfloat16})


def test_pairs_are_filtered_by_the_plans_training_dtype():
    plan = ca.compose(ca.module_replace(pairs=("test_fast_scale_bf16",)))
    applied = plan(Holder())
    model, _, _ = applied
    assert type(model.scale) is Scale
    assert "test_fast_scale_bf16: not used, it supports bfloat16 and this plan trains in float32" in plan.explain(
        applied=applied
    )
    plan = ca.compose(ca.module_replace(pairs=("test_fast_scale_bf16",)), ca.amp("bf16"))
    applied = plan(Holder())
    model, _, _ = applied
    assert type(model.scale) is FastScale
    assert "test_fast_scale_bf16: 1 x Scale -> FastScale (class swapped in place" in plan.explain(applied=applied)


def test_seed_keyword_form_builds_target_from_source_and_keeps_names():
    modules.register_replace_pair("test_built_scale", supported_dtypes={torch.float32}, pair_cls=(Scale, BuiltScale))
    model = Holder()
    w = model.scale.w
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = ca.compose(ca.module_replace(pairs="test_built_scale"))
    applied = plan(model, optim)
    model, optim, _ = applied
    assert type(model.scale) is BuiltScale and model.scale.w is w
    assert [n for n, _ in model.named_parameters()] == ["scale.w", "lin.weight", "lin.bias"]
    assert {id(p) for g in optim.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert "built as BuiltScale(module)" in plan.explain(applied=applied)


def test_target_that_renames_parameters_fails_before_the_model_changes():
    modules.register_replace_pair("test_renaming_scale", Scale, RenamingScale)
    model = Holder()
    with pytest.raises(ConfigError, match="same parameter names"):
        ca.compose(ca.module_replace(pairs=("test_renaming_scale",)))(model)
    assert type(model.scale) is Scale


def test_bad_pair_names_and_registrations_are_config_errors():
    with pytest.raises(ConfigError, match="module_replace.pairs"):
        ca.module_replace(pairs=("no_such_pair",))
    with pytest.raises(ConfigError, match="supported_dtypes"):
        modules.register_replace_pair("test_bad_dtypes", Scale, FastScale, supported_dtypes={torch.int8})
    with pytest.raises(ConfigError, match="source_cls"):
        modules.register_replace_pair("test_bad_source", "Scale", FastScale)
    with pytest.raises(ConfigError, match="not already registered"):
        modules.register_replace_pair("gpt_sdpa", Scale, FastScale)


def test_flash_pairs_are_chosen_only_on_capable_cuda():
    needs = modules.replace_pairs()["gpt_flash_attn"].needs
    assert "flash_attn" in needs(Environment(device="cuda", compute_capability=(9, 0)))
    assert "8.0" in needs(Environment(device="cuda", compute_capability=(7, 5), packages={"flash_attn"}))
    assert needs(Environment(device="cuda", compute_capability=(8, 0), packages={"flash_attn"})) is None
    assert issubclass(FlashCausalSelfAttention, CausalSelfAttention)


def test_seed_forms_and_candidates():
    from composable_atorch import strategy
    from composable_atorch.core.transform import SearchContext

    plan = strategy.load(["module_replace"])
    assert plan.transforms == (ca.module_replace(),)
    assert ca.Plan.from_json(plan.to_json()) == plan
    assert modules.ModuleReplace.candidates(SearchContext(env=Environment())) == (ca.module_replace(),)

"""Sequence splits on families nobody here wrote the attention of: sliding windows (Mistral,
Gemma-2/3, Cohere2, Qwen2 with its window on, GPT-OSS), Gemma-2's logit softcap and GPT-OSS's
attention sinks, each passed per layer through transformers' attention interface. Context 2
(all-gather) and Ulysses 2 train each equal to one process (fp32, atol 1e-4); the ring refuses what
it cannot compute before any step; a model that mixes tokens outside attention is refused by the
split's numerical guard (SequenceSplitMismatchError) instead of training on half-sequences.

Windows are 16 tokens at sequence 64 (each rank's load-balanced part is 32 tokens in two chunks of
16), so the window cuts across the parts; Mistral also runs with its default window (4096)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _seq
import composable_atorch as ca
from composable_atorch.errors import ConfigError, SequenceSplitMismatchError

from _dist import run_world

ATOL = 1e-4
WINDOW = 16
FAMILIES = ("gemma2", "gpt_oss", "cohere2", "gemma3", "qwen2_window")


def _family(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from zoo.pipeline import LAYER_TYPED

    config = LAYER_TYPED[name]()
    config.vocab_size, config.sliding_window = 256, WINDOW  # TextDataset's byte tokens; a window under 64
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _mistral_default(seed: int = 0):
    """Mistral as its config comes (sliding_window 4096), tiny."""
    from transformers import MistralForCausalLM

    from zoo.configs import cfg, shape

    torch.manual_seed(seed)
    return MistralForCausalLM(cfg("MistralConfig", **shape(32, num_key_value_heads=2, vocab_size=256)))


class ConvMixer(nn.Module):
    """A user's model with a causal convolution over time before attention (as Mamba-style hybrids
    and LFM2 have): under a split each rank's convolution would see only its own tokens."""

    def __init__(self, vocab=256, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, kernel_size=4, padding=3, groups=d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, position_ids=None):
        b, t = tokens.shape
        x = self.tok(tokens)
        x = x + self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.head(x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


def _conv(seed: int = 0):
    torch.manual_seed(seed)
    return ConvMixer()


_seq.MODELS.update({name: (lambda name=name: _family(name)) for name in FAMILIES})
_seq.MODELS.update({"mistral_default": _mistral_default, "conv_mixer": _conv})

CONTEXT = [(name, "sgd") for name in (*FAMILIES, "mistral_default")] + [("gemma2", "adamw"), ("gpt_oss", "adamw")]
ULYSSES = [(name, "sgd") for name in (*FAMILIES, "mistral_default")]


def _refusal(fn):
    try:
        fn()
    except (ConfigError, SequenceSplitMismatchError) as exc:
        return type(exc).__name__, str(exc)
    return "trained", ""


def _world2(rank, world):
    context = (ca.parallel_mode([("context", 2)]), ca.context_parallel())
    out = {("context",) + key: _seq.run(*key, *context) for key in CONTEXT}
    ulysses = (ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel())
    out.update({("ulysses",) + key: _seq.run(*key, *ulysses) for key in ULYSSES})
    ring = (ca.parallel_mode([("context", 2)]), ca.context_parallel(rotation="ring"))
    out["ring_mistral_default"] = _seq.run("mistral_default", "sgd", *ring)
    out["ring_window"] = _refusal(lambda: _seq.run("gemma2", "sgd", *ring))
    out["conv_context"] = _refusal(lambda: _seq.run("conv_mixer", "sgd", *context))
    out["conv_ulysses"] = _refusal(lambda: _seq.run("conv_mixer", "sgd", *ulysses))
    return out


@pytest.fixture(scope="module")
def world2():
    return run_world(_world2, 2)


def _equal(got, ref):
    for rank in (0, 1):
        dp, dl = _seq.close(got[rank], ref)
        assert dp < ATOL and dl < ATOL, (rank, dp, dl)
        assert got[rank]["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2)  # half of each sequence per rank


@pytest.mark.dist
@pytest.mark.parametrize("name,optim", CONTEXT)
def test_context_2_equals_one_process(world2, name, optim):
    _equal([world2[r][("context", name, optim)] for r in (0, 1)], _seq.reference(name, optim))
    assert "split output checked against the whole model's" in world2[0][("context", name, optim)]["explain"]


@pytest.mark.dist
@pytest.mark.parametrize("name,optim", ULYSSES)
def test_ulysses_2_equals_one_process(world2, name, optim):
    _equal([world2[r][("ulysses", name, optim)] for r in (0, 1)], _seq.reference(name, optim))


@pytest.mark.dist
def test_ring_runs_a_window_longer_than_the_sequence_and_refuses_a_shorter_one(world2):
    _equal([world2[r]["ring_mistral_default"] for r in (0, 1)], _seq.reference("mistral_default", "sgd"))
    for rank in (0, 1):
        kind, text = world2[rank]["ring_window"]
        assert kind == "ConfigError" and "rotation='ring'" in text and "sliding_window 16" in text, text
        assert "softcap" in text  # Gemma-2's attention softcap is named too


@pytest.mark.dist
@pytest.mark.parametrize("split", ["conv_context", "conv_ulysses"])
def test_a_token_mixer_outside_attention_is_refused_before_any_step(world2, split):
    for rank in (0, 1):
        kind, text = world2[rank][split]
        assert kind == "SequenceSplitMismatchError", (kind, text)
        assert "outside the attention" in text and "Fix:" in text


def test_windowed_attention_equals_transformers_mask_on_one_process():
    """The mask arithmetic itself: one rank holding the whole sequence (n == 1) against the eager
    formula with transformers' window rule (a key at most window-1 positions behind)."""
    from composable_atorch.transforms.parallel.sequence.attention import Features, attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    pos = torch.arange(12)
    sinks = torch.randn(2)
    got = attention(q, k, v, pos, pos, True, None, 0.0, Features(window=3, softcap=5.0, sinks=sinks))
    logits = torch.tanh(q @ k.transpose(-2, -1) / 2.0 / 5.0) * 5.0
    allowed = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 3)
    logits = logits.masked_fill(~allowed, float("-inf"))
    both = torch.cat([logits, sinks.view(1, 2, 1, 1).expand(1, 2, 12, 1)], dim=-1)
    want = torch.softmax(both, dim=-1)[..., :-1] @ v
    torch.testing.assert_close(got, want)

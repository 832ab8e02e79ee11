"""The sequence split's numerical guard (sequence/check.py): before any step, one probe sequence runs
through the whole model and through the split one on each rank's part. A model that mixes tokens
outside the attention the split reroutes (here a user's causal convolution over time, as Mamba-style
hybrids and LFM2 have) is refused with SequenceSplitMismatchError instead of training on
half-sequences; a model the split computes exactly passes and says so in explain()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _seq
import composable_atorch as ca
from composable_atorch.errors import ConfigError, SequenceInputError, SequenceSplitMismatchError

from _dist import module_world


class ConvMixer(nn.Module):
    """A user's model with a causal convolution over time before attention: under a split each
    rank's convolution would see only its own tokens."""

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


_seq.MODELS["conv_mixer"] = _conv


def _refusal(fn):
    try:
        fn()
    except (ConfigError, SequenceSplitMismatchError) as exc:
        return type(exc).__name__, str(exc)
    return "trained", ""


def _own_loader(*transforms):
    """The user's own loop: the plan applied to the model and optimizer only, every rank training on
    the whole batches of its own loader (the split never sees them)."""
    model = _seq.MODELS["llama"]()
    optim = _seq.make_optim(model, "sgd")
    model, optim, _ = ca.compose(*transforms)(model, optim)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(_seq.loader()))
    try:
        ca.train_step(model, optim, x, y, _seq.seq_loss)
    except SequenceInputError as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        return type(exc).__name__, str(exc), unchanged
    return "trained", "", False


def _world2(rank, world):
    context = (ca.parallel_mode([("context", 2)]), ca.context_parallel())
    ulysses = (ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel())
    return {
        "conv_context": _refusal(lambda: _seq.run("conv_mixer", "sgd", *context)),
        "conv_ulysses": _refusal(lambda: _seq.run("conv_mixer", "sgd", *ulysses)),
        "llama": _seq.run("llama", "sgd", *context)["explain"],
        "own_loader_context": _own_loader(*context),
        "own_loader_ulysses": _own_loader(*ulysses),
    }


world2 = module_world(_world2, 2)


@pytest.mark.dist
@pytest.mark.parametrize("split", ["conv_context", "conv_ulysses"])
def test_a_token_mixer_outside_attention_is_refused_before_any_step(world2, split):
    for rank in (0, 1):
        kind, text = world2[rank][split]
        assert kind == "SequenceSplitMismatchError", (kind, text)
        assert "outside the attention" in text and "Fix:" in text


@pytest.mark.dist
def test_an_exact_split_passes_the_guard_and_says_so(world2):
    assert "split output checked against the whole model's on a probe sequence" in world2[0]["llama"]


@pytest.mark.dist
@pytest.mark.parametrize("split", ["own_loader_context", "own_loader_ulysses"])
def test_the_same_whole_batch_on_every_rank_is_refused_before_the_step(world2, split):
    """Found by a user's habit: the plan applied to the model and optimizer, the loop over their own
    loader. Every rank then held the whole batch, and the split trained 1e-3 to 1e-2 off one process
    in three steps, silently."""
    for rank in (0, 1):
        kind, text, unchanged = world2[rank][split]
        assert kind == "SequenceInputError", (kind, text)
        assert "same batch (4, 64)" in text and "loader it returns" in text
        assert unchanged  # refused in the forward: no weight moved

"""The sequence splits on transformers families nobody here picked: context parallel (all-gather and
ring) and Ulysses at world 2, sequence 64, each equal to one process (fp32, atol 1e-4) with the
family's own default attention implementation as the reference.

The families' per-layer attention features are what is checked: sliding windows (Mistral, Qwen2 with
use_sliding_window, Gemma-2/3, GPT-OSS, Cohere2; a window of 8 tokens so it matters), Gemma-2's logit
softcapping and GPT-OSS's attention sinks (computed over global positions), plus Phi-3's fused
projections and OLMo-2's norms on the whole projection; encoders (non-causal): BERT (dropout off to
compare) and ModernBERT (bidirectional local windows). The ring cannot merge capped logits or sinks:
a typed refusal before any step names the reason. Chunked attention (Llama-4) is refused from its
config.
"""

from __future__ import annotations

import functools

import pytest

import _seq
import composable_atorch as ca
import equivalence as eq
from composable_atorch.errors import ConfigError
from zoo.sequence import DECODERS, ENCODERS, build

from _dist import run_world

ATOL = 1e-4
_seq.MODELS.update({f"zoo_{name}": functools.partial(build, name) for name in DECODERS | ENCODERS})

#: (family, optimizer): every family with SGD; AdamW on a Llama-like one and the featured ones
CASES = [(name, "sgd") for name in DECODERS | ENCODERS] + [(n, "adamw") for n in ("mistral", "gemma2", "gpt_oss")]
#: the ring's refusals: family -> the reason's words
RING_REFUSED = {"gemma2": "softcapping", "gpt_oss": "sinks"}
MODES = {
    "allgather": lambda: (ca.parallel_mode([("context", 2)]), ca.context_parallel()),
    "ring": lambda: (ca.parallel_mode([("context", 2)]), ca.context_parallel(rotation="ring")),
    "ulysses": lambda: (ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel()),
}


def _world(rank, world, mode):
    out = {}
    for name, optim_name in CASES:
        out[(name, optim_name)] = _seq.run_or_refusal(f"zoo_{name}", optim_name, *MODES[mode]())
    return out


@functools.cache
def _reference(name, optim_name):
    return _seq.reference(f"zoo_{name}", optim_name)


@pytest.mark.dist
@pytest.mark.parametrize("mode", sorted(MODES))
def test_families_equal_one_process(mode):
    got = run_world(_world, 2, mode)
    failures = []
    for name, optim_name in CASES:
        result = got[0][(name, optim_name)]
        if mode == "ring" and name in RING_REFUSED:
            assert isinstance(result, str) and RING_REFUSED[name] in result and "allgather" in result, result
            continue
        assert not isinstance(result, str), (name, optim_name, result)
        assert result["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2)  # each rank holds half of each sequence
        ref = _reference(name, optim_name)
        params, losses = eq.gaps(result, ref)
        start = eq.full_params(_seq.MODELS[f"zoo_{name}"]())
        assert eq.max_diff(ref[0], start) > 1e-3, name  # training moved the weights
        if not (params < ATOL and losses < ATOL):
            failures.append((name, optim_name, params, losses))
    assert not failures, failures


def test_chunked_attention_refused():
    """Llama-4's chunked attention lives only in the mask transformers builds: refused from the config."""
    from composable_atorch.transforms.parallel.sequence.attention import Attend, check_mask_features
    from zoo.configs import cfg

    config = cfg("Llama4TextConfig", attention_chunk_size=8)
    with pytest.raises(ConfigError, match="attention_chunk_size"):
        check_mask_features(config, Attend(kind="context", group=None, rank=0, n=2, who="context_parallel"))
    gemma2 = DECODERS["gemma2"]()
    check_mask_features(gemma2, Attend(kind="context", group=None, rank=0, n=2, who="context_parallel"))
    with pytest.raises(ConfigError, match="softcapping.*allgather"):
        check_mask_features(
            gemma2, Attend(kind="context", group=None, rank=0, n=2, who="context_parallel", rotation="ring")
        )

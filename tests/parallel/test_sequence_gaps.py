"""context_parallel and Ulysses in the compositions issue 29 names that were refused or untested, each
equal to one process on the same global batches (fp32, atol 1e-4, every rank's parameters and losses):

* checkpoint on a plain user model's blocks (its scaled_dot_product_attention recomputed in backward
  must still see the whole sequence): context 2, Ulysses 2 and the ring, SGD and AdamW, world 2;
* several pipeline stages per rank (interleaved schedule) with context 2: world 4;
* hybrid fsdp (replicate 2 x shard 2) with context 2: world 8;
* mixed_parallel with a sequence split: a typed refusal naming the composition that runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _seq
import composable_atorch as ca
from composable_atorch.errors import ConfigError

from _dist import run_world

ATOL = 1e-4


class Block(nn.Module):
    """A user's transformer block: fused causal attention and an MLP."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.o = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BlockLM(nn.Module):
    """A plain user model built of :class:`Block` s, taking global ``position_ids``."""

    def __init__(self, vocab=256, d=32, layers=2, max_len=_seq.SEQ):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(tokens.size(1), device=tokens.device)[None]
        x = self.tok(tokens) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def block_lm(seed: int = 0) -> BlockLM:
    torch.manual_seed(seed)
    return BlockLM()


def llama4(seed: int = 0):
    """Four decoder layers: two pipeline ranks x two stages each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=_seq.SEQ,
    )
    return LlamaForCausalLM(cfg)


_seq.MODELS["block_lm"] = block_lm
_seq.MODELS["llama4"] = llama4


def _split(kind):
    if kind == "context":
        return "context", ca.context_parallel()
    if kind == "ring":
        return "context", ca.context_parallel(rotation="ring")
    return "sequence", ca.sequence_parallel()


CKPT_CASES = [("sgd", "context", False), ("adamw", "context", False), ("sgd", "ulysses", False)]
CKPT_CASES += [("adamw", "ulysses", False), ("adamw", "ring", False), ("sgd", "context", True)]


def _world2(rank, world):
    out = {}
    for optim_name, kind, reentrant in CKPT_CASES:
        dim, split = _split(kind)
        out[(optim_name, kind, reentrant)] = _seq.run(
            "block_lm", optim_name, ca.parallel_mode([(dim, 2)]), split, ca.checkpoint(Block, reentrant=reentrant)
        )
    return out


@pytest.fixture(scope="module")
def world2():
    return run_world(_world2, 2)


@pytest.mark.dist
@pytest.mark.parametrize("optim_name,kind,reentrant", CKPT_CASES)
def test_split_with_checkpoint_on_a_user_model_equals_one_process(world2, optim_name, kind, reentrant):
    ref = _seq.reference("block_lm", optim_name)
    for rank in range(2):
        got = world2[rank][(optim_name, kind, reentrant)]
        assert got["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2)
        dp, dl = _seq.close(got, ref)
        assert dp < ATOL and dl < ATOL, (rank, dp, dl)
    assert "2 module(s) checkpointed (Block)" in got["explain"]
    assert "recompute attends over the whole sequence" in got["explain"]


def _compare(results, key, model_name, optim_name, world):
    """Every rank's parameters (a pipeline stage's own) and losses against one process; the ranks hold
    the whole model between them."""
    params, losses = _seq.reference(model_name, optim_name)
    held = set()
    for rank in range(world):
        got = results[rank][key]
        assert got["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2), got["shapes"]
        held |= set(got["params"])
        dp = max((torch.as_tensor(v) - params[k]).abs().max().item() for k, v in got["params"].items())
        dl = max(abs(x - y) for x, y in zip(got["losses"], losses, strict=True))
        assert dp < ATOL and dl < ATOL, (rank, dp, dl)
    assert held == set(params)
    return got


MIXED_CASES = [("llama", "sgd", "context", "tensor"), ("llama", "adamw", "ulysses", "pipeline")]
MIXED_CASES += [("llama", "adamw", "ring", "tensor")]
INTERLEAVED_CASES = [("sgd", "context"), ("adamw", "ring")]


def _world4(rank, world):
    out = {}
    for model_name, optim_name, kind, other in MIXED_CASES:
        dim, split = _split(kind)
        out[("mixed", model_name, optim_name, kind)] = _seq.run(
            model_name, optim_name, ca.parallel_mode([(dim, 2), (other, 2)]), ca.mixed_parallel(), split
        )
    for optim_name, kind in INTERLEAVED_CASES:
        dim, split = _split(kind)
        pp = ca.pipeline_parallel(schedule="Interleaved1F1B", stages_per_rank=2)
        out[("interleaved", optim_name, kind)] = _seq.run(
            "llama4", optim_name, ca.parallel_mode([(dim, 2), ("pipeline", 2)]), split, pp
        )
    try:  # a context dimension without context_parallel: every context rank would train the same tokens
        _seq.run("llama", "sgd", ca.parallel_mode([("context", 2), ("tensor", 2)]), ca.mixed_parallel())
        out["mixed_no_split"] = "trained"
    except ConfigError as exc:
        out["mixed_no_split"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world4():
    return run_world(_world4, 4)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name,kind,other", MIXED_CASES)
def test_mixed_parallel_with_a_split_equals_one_process(world4, model_name, optim_name, kind, other):
    got = _compare(world4, ("mixed", model_name, optim_name, kind), model_name, optim_name, 4)
    split = "sequence_parallel" if kind == "ulysses" else "context_parallel"
    assert "mixed_parallel(" in got["explain"] and f"| {split}(" in got["explain"]  # expanded around the split


@pytest.mark.dist
def test_mixed_parallel_with_a_split_dimension_and_no_split_is_refused(world4):
    assert "add context_parallel() to the plan" in world4[0]["mixed_no_split"]


@pytest.mark.dist
@pytest.mark.parametrize("optim_name,kind", INTERLEAVED_CASES)
def test_context_2_with_two_pipeline_stages_per_rank_equals_one_process(world4, optim_name, kind):
    got = _compare(world4, ("interleaved", optim_name, kind), "llama4", optim_name, 4)
    assert "Interleaved1F1B" in got["explain"]


def test_mixed_parallel_runs_the_split_between_its_steps():
    env = ca.Environment(world_size=4)
    for mode, split in ((("context", 2), ca.context_parallel()), (("sequence", 2), ca.sequence_parallel())):
        plan = ca.compose(ca.parallel_mode([mode, ("tensor", 2)]), split, ca.mixed_parallel(), env=env)
        assert plan.names == ("parallel_mode", "tensor_parallel", split.name, "ddp")  # its parts, the split between


HYBRID_CASES = [("user", "sgd"), ("llama", "adamw")]
HYBRID_STEPS = 2


def _world8(rank, world):
    groups = [("context", 2), ("zero", 2), ("data", 2)]  # hybrid fsdp: replicate 2 x shard 2, beside context 2
    return {
        case: _seq.run(*case, ca.parallel_mode(groups), ca.context_parallel(), ca.fsdp(), steps=HYBRID_STEPS)
        for case in HYBRID_CASES
    }


@pytest.fixture(scope="module")
def world8():
    return run_world(_world8, 8)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name", HYBRID_CASES)
def test_context_2_with_hybrid_fsdp_equals_one_process(world8, model_name, optim_name):
    ref = _seq.reference(model_name, optim_name, steps=HYBRID_STEPS)
    for rank in range(8):
        got = world8[rank][(model_name, optim_name)]
        assert got["shapes"][0] == (_seq.BATCH // 4, _seq.SEQ // 2)  # the batch over data 2 x zero 2
        dp, dl = _seq.close(got, ref)
        assert dp < ATOL and dl < ATOL, (rank, dp, dl)
    assert "hybrid (HSDP, 2-D mesh (data, zero))" in got["explain"]

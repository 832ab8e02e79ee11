"""ATorch's Llama2 3-D example's TPInfo, written for transformers 4, through the compat facade.

Its ``shrink({"self_attn": {"num_heads", "num_key_value_heads", "hidden_size"}})`` names attributes
transformers 5's LlamaAttention no longer has (it reshapes by head_dim); the facade drops them with a
note, leaves the caller's objects unchanged, and keeps the planner's error for a user's own module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from composable_atorch.compat.atorch.auto.opt_lib.ds_3d_parallel_optimization import (
    DeepSpeed3DParallelConfig,
    vocab_parallel_logit_helper,
)
from composable_atorch.compat.atorch.tensor_parallel.manual_tp import TPInfo
from composable_atorch.compat.tp_shrink import resolve_shrinks
from composable_atorch.transforms.parallel.tensor import TensorParallel
from composable_atorch.transforms.parallel.tensor.planner import TensorParallelPlanError
from zoo.configs import llama_config

transformers = pytest.importorskip("transformers")


def atorch_llama_tpinfo():
    """ATorch's get_llama_tpinfo(), verbatim."""
    llama_tpinfo = TPInfo()
    llama_tpinfo.shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    llama_tpinfo.shard_row("self_attn.o_proj", "mlp.down_proj")
    llama_tpinfo.shard_vocab("embed_tokens")
    llama_tpinfo.shrink({"self_attn": {"num_heads", "num_key_value_heads", "hidden_size"}})
    return llama_tpinfo


def tiny_llama():
    return transformers.LlamaModel(llama_config(vocab=64))


def test_transformers5_llama_shrinks_are_dropped_with_a_note_and_the_plan_resolves():
    model = tiny_llama()
    cfg = DeepSpeed3DParallelConfig(tpinfo=atorch_llama_tpinfo())
    strategy = [("parallel_mode", ([("tensor", 2), ("pipeline", 1)], None)), ("deepspeed_3d_parallel", cfg)]
    with pytest.raises(TensorParallelPlanError, match="no integer attribute to shrink"):
        TensorParallel(plan=cfg.tpinfo).placements(model, 2)  # the library alone refuses it
    out, notes = resolve_shrinks(model, strategy)
    resolved = out[1][1]
    assert resolved is not cfg and cfg.tpinfo.entries == atorch_llama_tpinfo().entries  # caller's objects kept
    assert [e for e in resolved.tpinfo.entries if e[0] == "shrink"] == []
    assert len(resolved.tpinfo.entries) == len(cfg.tpinfo.entries) - 1
    assert len(notes) == 1 and "LlamaAttention has no such attribute" in notes[0] and "head_dim" in notes[0]
    shard, shrink, _ = TensorParallel(plan=resolved.tpinfo).placements(model, 2)  # verified by a forward
    assert shrink == {} and shard["layers.0.self_attn.q_proj"][0] == "col"
    assert resolved.logit_helper is vocab_parallel_logit_helper  # ATorch's sliced logits, kept by the copy


def test_existing_attributes_and_user_modules_are_left_to_the_planner():
    model = tiny_llama()
    info = TPInfo().shard_col("mlp.up_proj").shard_row("mlp.down_proj").shrink({"mlp": {"hidden_size"}})
    same, notes = resolve_shrinks(model, [("tensor_parallel", info)])  # LlamaMLP has hidden_size: kept
    assert same[0][1] is info and notes == ()

    class Attention(nn.Module):  # a user's module: a missing attribute stays the planner's error
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    user = nn.Sequential(Attention())
    info = TPInfo().shrink({"0": {"num_heads"}})
    assert resolve_shrinks(user, [("tensor_parallel", info)]) == ([("tensor_parallel", info)], ())
    assert resolve_shrinks(model, "strategy.json") == ("strategy.json", ())  # other forms as they are


def test_compat_config_defaults_to_atorch_logits_only_with_a_vocabulary_parallel_tpinfo():
    from composable_atorch.transforms.parallel.ds3d import DeepSpeed3DParallelConfig as LibraryConfig

    assert DeepSpeed3DParallelConfig(tpinfo=atorch_llama_tpinfo()).logit_helper is vocab_parallel_logit_helper
    assert DeepSpeed3DParallelConfig().logit_helper is None
    mine = lambda embed, out: out  # noqa: E731 - a user's helper is kept
    assert DeepSpeed3DParallelConfig(tpinfo=atorch_llama_tpinfo(), logit_helper=mine).logit_helper is mine
    assert LibraryConfig(tpinfo=atorch_llama_tpinfo()).logit_helper is not vocab_parallel_logit_helper
    # without a vocabulary-parallel embedding the helper is the plain tied product
    embed = nn.Embedding(10, 4)
    hidden = torch.randn(2, 3, 4)
    assert torch.equal(vocab_parallel_logit_helper(embed, hidden), hidden @ embed.weight.T)

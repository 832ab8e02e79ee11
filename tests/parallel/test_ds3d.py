"""ds_3d_parallel's pure parts: record_module_init, the config, the contract, the DeepSpeed config, the module walk.

The world-4 training checks live in test_ds3d_dist.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import composable_atorch as ca
from composable_atorch.core.transform import lookup
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, ConflictError
from composable_atorch.transforms.parallel.ds3d import DeepSpeed3DParallel
from composable_atorch.transforms.parallel.ds3d.build import (
    check_model,
    default_patcher,
    module_list,
    stage_bounds,
    vocab_parallel_logit_helper,
)
from composable_atorch.transforms.parallel.ds3d.engine import engine_config, original_name
from zoo.configs import llama_config

WORLD4 = Environment.detect().with_(world_size=4)


def _inits():
    """Every nn.Module subclass's own __init__ (what record_module_init patches)."""
    out, stack = {}, [nn.Module]
    while stack:
        c = stack.pop()
        for s in c.__subclasses__():
            if s not in out:
                out[s] = s.__dict__.get("__init__")
                stack.append(s)
    return out


# -- record_module_init ----------------------------------------------------------------------------


def test_record_module_init_builds_on_meta_and_records_args():
    with ca.record_module_init():
        lin = nn.Linear(3, 5, bias=False)
        seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert lin.weight.is_meta and lin._init_args == (3, 5) and lin._init_kwargs == {"bias": False}
    assert seq[0].weight.is_meta and seq._init_args == (seq[0], seq[1]) or seq._init_args  # recorded either way
    assert not nn.Linear(2, 2).weight.is_meta  # outside: real again


def test_record_module_init_restores_every_class_also_when_the_body_raises():
    before = _inits()
    hook = nn.Module.__dict__.get("__init_subclass__")
    with pytest.raises(RuntimeError, match="boom"), ca.record_module_init():

        class Inside(nn.Linear):
            def __init__(self, n):
                super().__init__(n, n)

        Inside(2)
        raise RuntimeError("boom")
    after = _inits()
    changed = [c for c, init in before.items() if after.get(c) is not init]
    assert changed == []
    assert Inside.__dict__["__init__"].__qualname__.endswith(
        "Inside.__init__"
    )  # its own init, not a wrapper or its parent's
    assert nn.Module.__dict__.get("__init_subclass__") is hook
    assert not nn.Linear(2, 2).weight.is_meta and not Inside(2).weight.is_meta
    assert not hasattr(Inside(2), "_init_args")


def test_a_recorded_hf_model_walks_into_the_module_list():
    transformers = pytest.importorskip("transformers")
    cfg = llama_config(layers=3, vocab=64, tie_word_embeddings=False)
    with ca.record_module_init():
        meta = transformers.LlamaForCausalLM(cfg)
    names = [n for n, _ in module_list(meta)]
    assert names == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "model.rotary_emb",
        "lm_head",
    ]
    with pytest.raises(ConfigError, match="tie_first"):
        check_model(meta, module_list(meta), tie_first=True)  # its lm_head has its own weight
    entries, head = check_model(meta, module_list(meta), tie_first=False)
    assert head is None and len(entries) == 7
    assert original_name("3.self_attn.q_proj.weight", entries, False) == "model.layers.2.self_attn.q_proj.weight"
    cfg.tie_word_embeddings = True
    with ca.record_module_init():
        tied = transformers.LlamaForCausalLM(cfg)
    entries, head = check_model(tied, module_list(tied), tie_first=True)
    assert head == "lm_head" and entries[-1][0] == "model.rotary_emb"
    assert original_name("tied_modules.model_embed_tokens.weight", entries, True) == "model.embed_tokens.weight"


def test_unrecorded_meta_modules_are_a_config_error():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="record_module_init"):
        check_model(meta, module_list(meta), tie_first=False)


def test_default_patcher_passes_extra_pipe_tensors_along():
    norm = nn.LayerNorm(4)
    fw = default_patcher(norm.forward, norm)
    h, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.long)
    out = fw((h, mask))
    assert torch.equal(out[0], norm(h)) and out[1] is mask
    assert torch.equal(fw(h), norm(h))


# -- the config and the contract ---------------------------------------------------------------------


def test_both_seed_names_and_the_seed_config():
    assert lookup("ds_3d_parallel") is lookup("deepspeed_3d_parallel") is DeepSpeed3DParallel
    cfg = ca.DeepSpeed3DParallelConfig()
    assert (cfg.base_seed, cfg.tie_first, cfg.logit_helper, cfg.ds_config, cfg.custom_patcher) == (
        1234,
        True,
        None,
        None,
        {},
    )
    assert isinstance(cfg.tpinfo, ca.TPInfo)
    batch = object()
    assert cfg.batch_fn(batch) is batch  # ATorch's default batch_fn: the identity, which ATorch code calls
    default = ca.compose(ca.parallel_mode([("data", 2), ("pipeline", 2)]), ca.ds_3d_parallel(cfg), env=WORLD4)
    assert ca.Plan.from_json(default.to_json(), env=WORLD4) == default  # the default keeps the plan JSON
    vocab = ca.DeepSpeed3DParallelConfig(tpinfo=ca.TPInfo().shard_vocab("wte"))
    assert vocab.logit_helper is vocab_parallel_logit_helper
    plan = ca.strategy.load(
        [("parallel_mode", ([("data", 2), ("pipeline", 2)], None)), ("deepspeed_3d_parallel", cfg)], env=WORLD4
    )
    assert plan.names == ("parallel_mode", "ds_3d_parallel")  # no ddp implied: the engine owns gradient sync


def test_a_data_only_config_round_trips_as_json_and_functions_do_not():
    t = ca.ds_3d_parallel(
        tpinfo=ca.TPInfo().shard_col("q").shard_row("o"),
        tie_first=False,
        ds_config={"gradient_accumulation_steps": 4, "x": [1, 2]},
    )
    plan = ca.compose(ca.parallel_mode([("tensor", 2), ("pipeline", 2)]), t, env=WORLD4)
    assert ca.Plan.from_json(plan.to_json(), env=WORLD4) == plan
    with_fn = ca.ds_3d_parallel(ca.DeepSpeed3DParallelConfig(batch_fn=lambda b: b))
    with pytest.raises(ConfigError):
        ca.compose(ca.parallel_mode([("pipeline", 2)]), with_fn, env=WORLD4).to_json()


@pytest.mark.parametrize(
    "other",
    [
        "ddp",
        "fsdp",
        "zero1",
        "zero2",
        "tensor_parallel",
        "pipeline_parallel",
        "mixed_parallel",
        "accumulate",
        "checkpoint",
    ],
)
def test_conflicts_each_with_its_reason(other):
    extra = {"checkpoint": [nn.Linear]}.get(other)
    t = lookup(other).from_seed(extra)
    with pytest.raises(ConflictError) as info:
        ca.compose(ca.parallel_mode([("data", 2), ("pipeline", 2)]), ca.ds_3d_parallel(), t, env=WORLD4)
    assert "ds_3d_parallel" in str(info.value) and info.value.reason


def test_zero_dimension_and_custom_rank_order_conflict_with_deepspeeds_topology():
    with pytest.raises(ConflictError, match="topology"):
        ca.compose(ca.parallel_mode([("zero", 2), ("pipeline", 2)]), ca.ds_3d_parallel(), env=WORLD4)


def test_bad_config_values_are_typed_errors():
    with pytest.raises(ConfigError, match="ds_config"):
        ca.ds_3d_parallel(ds_config="/no/such/ds_config.json")
    with pytest.raises(ConfigError, match="custom_patcher"):
        ca.ds_3d_parallel(custom_patcher={"h.0": "not a function"})
    with pytest.raises(ConfigError, match="base_seed"):
        ca.ds_3d_parallel(base_seed="x")


# -- the DeepSpeed config derived from the plan -------------------------------------------------------


def test_engine_config_from_the_plan():
    c = engine_config({}, data_size=2, stages=2, per_rank_batch=8, clip=1.0, half="bf16")
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (4, 2, 16)
    assert c["gradient_clipping"] == 1.0 and c["bf16"]["enabled"] and c["zero_optimization"]["stage"] == 0
    c = engine_config(
        {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}},
        data_size=1,
        stages=2,
        per_rank_batch=8,
        clip=None,
        half=None,
    )
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["zero_optimization"]["stage"]) == (
        2,
        4,
        1,
    )
    c = engine_config({}, data_size=2, stages=4, per_rank_batch=None, clip=None, half=None)
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (1, 4, 8)


@pytest.mark.parametrize(
    ("user", "key", "kw"),
    [
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, "gradient_accumulation_steps", {}),
        ({"train_batch_size": 7}, "train_batch_size", {}),
        ({"gradient_clipping": 0.5}, "gradient_clipping", {"clip": 1.0}),
        ({"fp16": {"enabled": True}}, "fp16", {"half": "bf16"}),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization", {}),
    ],
)
def test_a_ds_config_contradicting_the_plan_names_the_key(user, key, kw):
    args = {"data_size": 2, "stages": 2, "per_rank_batch": 8, "clip": None, "half": None, **kw}
    with pytest.raises(ConfigError) as info:
        engine_config(user, **args)
    assert key in info.value.field


def test_stages_split_the_blocks_evenly():
    # embedding, pos, 2 blocks, norm, head: one block per stage (DeepSpeed's type: balancing gave 0 / 2)
    assert stage_bounds([False, False, True, True, False, False], 2) == [0, 3, 6]
    assert stage_bounds([False, True, True, True, False], 2) == [0, 3, 5]
    assert stage_bounds([False, True, True, True, True, False], 4) == [0, 2, 3, 4, 6]


def test_a_tensor_size_that_splits_heads_is_a_config_error():
    transformers = pytest.importorskip("transformers")
    cfg = llama_config(vocab=64)
    with ca.record_module_init():
        meta = transformers.LlamaForCausalLM(cfg)
    t = ca.ds_3d_parallel(
        tpinfo=ca.TPInfo().shard_col("q_proj", "k_proj", "v_proj").shard_row("o_proj"), tie_first=False
    )
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        t._tp_placements(meta, 4)
    shard, _, _ = t._tp_placements(meta, 2)
    assert sorted(shard)[0] == "model.layers.0.self_attn.k_proj"


def test_the_block_class_is_the_listed_one_not_the_most_common_leaf():
    from composable_atorch.models.gpt import GPT, GPTConfig
    from composable_atorch.transforms.parallel.ds3d.build import block_class

    model = GPT(GPTConfig(n_layer=2))  # two embeddings, two blocks
    assert block_class(module_list(model)) == ("Block", 2)

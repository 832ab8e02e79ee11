"""Smoke test of benchmarks/memory.py's measurement functions (the benchmark itself is not run here).

The model-parallel part runs torch's fake process group in this process (no spawn): each test
opens and destroys its own group.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import composable_atorch as ca
from composable_atorch.models import GPT, Block, GPTConfig

_spec = importlib.util.spec_from_file_location(
    "memory_benchmark", Path(__file__).parents[2] / "benchmarks" / "memory.py"
)
memory = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = memory  # its dataclasses look their module up
_spec.loader.exec_module(memory)


def test_state_bytes_counts_params_grads_and_adam_state_exactly():
    model = torch.nn.Linear(4, 3)  # 15 float32 values
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    # Adam keeps exp_avg and exp_avg_sq per parameter (2 x 60 bytes) and a float32 step per tensor (2 x 4)
    assert memory.state_bytes(model, optim) == {"params": 60, "grads": 60, "optimizer": 128, "total": 248}


def test_checkpointing_reduces_measured_activation_bytes():
    tokens = torch.randint(0, 256, (2, 32))
    sizes = {}
    for name, plan in (("none", ca.compose()), ("checkpoint", ca.checkpoint(Block))):
        torch.manual_seed(0)
        model, _, _ = plan(GPT(GPTConfig(seq_len=32, d_model=32, n_layer=4, n_head=2)))
        sizes[name] = memory.activation_bytes(model, tokens)
    for how in ("saved", "profiler"):
        assert 0 < sizes["checkpoint"][how] < sizes["none"][how] / 2, (how, sizes)


# -- model-parallel rows (issue 10): the fake-group way on a tiny Llama, in this process ------------

# HF Llama's tp_plan: base_model_tp_plan's projections, plus the model-level lm_head (colwise, logits gathered)
TP_SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _module(name: str) -> str:
    return name.split(".")[-2]  # the module a parameter belongs to


def _whole_bytes():
    return {n: p.numel() * p.element_size() for n, p in memory.llama(memory.LLAMA_TINY, meta=True).named_parameters()}


def _per_name(lay):
    with memory.fake_world(lay.world):
        return memory.meta_sharded(memory.LLAMA_TINY, lay)


def test_tp2_fsdp4_holds_one_eighth_of_sharded_layers_and_one_quarter_of_the_rest_per_rank():
    rows, stages = _per_name(memory.Layout("tp_fsdp", tensor=2, data=4))
    whole = _whole_bytes()
    assert stages is None and rows.keys() == whole.keys()
    for name, (param, grad, adam) in rows.items():
        sharded = _module(name) in TP_SHARDED
        assert param * (8 if sharded else 4) == whole[name], name  # tiny sizes divide exactly: no rounding
        assert grad == param, name
        assert adam == 2 * param + 4, name  # exp_avg, exp_avg_sq in the parameter's layout, a float32 step
    total = sum(r[0] for r in rows.values())
    sharded_whole = sum(b for n, b in whole.items() if n.split(".")[-2] in TP_SHARDED)
    assert total == sharded_whole // 8 + (sum(whole.values()) - sharded_whole) // 4


def test_tp2_replicates_what_it_does_not_shard_and_the_data_dimension_replicates_everything():
    whole = _whole_bytes()
    for lay in (memory.Layout("tp", tensor=2), memory.Layout("tp", tensor=2, data=2)):
        rows, _ = _per_name(lay)
        for name, (param, grad, _adam) in rows.items():
            assert param * (2 if _module(name) in TP_SHARDED else 1) == whole[name], (lay, name)
            assert grad == param


def test_pipeline_rows_are_cut_where_pipeline_parallel_cuts_and_cover_every_parameter_once():
    lay = memory.Layout("tp_pp", tensor=2, pipeline=2)
    rows, stages = _per_name(lay)
    assert len(stages) == 2 and not stages[0] & stages[1] and stages[0] | stages[1] == set(rows)
    layers = [{int(n.split(".")[2]) for n in s if ".layers." in n} for s in stages]
    assert layers == [{0, 1}, {2, 3}]  # 4 equal blocks; embeddings ride with the first stage, norm + head with the last
    assert "model.embed_tokens.weight" in stages[0] and {"model.norm.weight", "lm_head.weight"} <= stages[1]
    with memory.fake_world(lay.world):
        heaviest = memory.meta_state(memory.LLAMA_TINY, lay)
    assert heaviest["source"] == "meta+cut" and heaviest["total"] == max(heaviest["stages"])
    assert heaviest["params"] == max(sum(rows[n][0] for n in s) for s in stages)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_row_matches_the_plans_arithmetic_and_a_wrong_expectation_is_caught(world):
    with memory.fake_world(world):
        for lay in memory.layouts(world):
            if lay.pipeline > memory.LLAMA_TINY["num_hidden_layers"]:
                continue  # pp8 needs 8 blocks (7B has 32); the tiny model has 4
            if not memory.FAMILIES[lay.family].on_fake:
                continue  # DeepSpeed 3D builds its own stages under real collectives: compared on gloo instead
            b = memory.meta_state(memory.LLAMA_TINY, lay)
            expected = memory.expected_state(memory.LLAMA_TINY, lay)
            assert memory.check(b, expected) == "ok", (lay, b, expected)
            assert memory.check(b, {**expected, "params": 2 * expected["params"]}).startswith("params 0.500x")

"""context_parallel and Ulysses composed with other parallelism at world 4, each equal to one process
(fp32, atol 1e-4): context 2 x tensor 2 and Ulysses 2 x tensor 2 (Llama, and a user model whose
attention reads its heads from the width), context 2 x pipeline 2 and Ulysses 2 x pipeline 2
(Llama; a model whose own forward takes the positions is refused there), Ulysses 2 x fsdp 2,
context 2 x fsdp over ATorch's ``zero`` group (hybrid sharding proper, replicate x shard beside
context 2, at world 8: test_sequence_gaps.py), and Ulysses with checkpoint(Block) at world 2."""

from __future__ import annotations

import pytest

import _seq
import composable_atorch as ca
import equivalence as eq

from _dist import module_world, run_world

ATOL = 1e-4
HALF = (_seq.BATCH, _seq.SEQ // 2)  # half of each sequence per rank


TP_CASES = [("llama", "sgd", "context"), ("llama", "adamw", "ulysses"), ("heads_from_width", "adamw", "context")]
TP_CASES += [("heads_from_width", "sgd", "ulysses"), ("llama", "adamw", "ring")]
PP_CASES = [("llama", "sgd", "context"), ("llama", "adamw", "ulysses"), ("llama", "adamw", "ring")]
FSDP_CASES = [("user", "adamw", "ulysses", "fsdp"), ("llama", "sgd", "ulysses", "fsdp")]
FSDP_CASES += [("llama", "adamw", "context", "zero")]


def _world4(rank, world):
    out = {}
    for model_name, optim_name, kind in TP_CASES:
        dim, split = _seq.split(kind)
        out[("tp", model_name, optim_name, kind)] = _seq.run(
            model_name, optim_name, ca.parallel_mode([(dim, 2), ("tensor", 2)]), split, ca.tensor_parallel()
        )
    for model_name, optim_name, kind, how in FSDP_CASES:
        dim, split = _seq.split(kind)
        if how == "zero":  # fsdp shards over ATorch's zero group (the hybrid layout with one replica)
            groups = [(dim, 2), ("zero", 2), ("data", 1)]
        else:
            groups = [(dim, 2), ("data", 2)]
        out[(how, model_name, optim_name, kind)] = _seq.run(
            model_name, optim_name, ca.parallel_mode(groups), split, ca.fsdp()
        )
    for model_name, optim_name, kind in PP_CASES:
        dim, split = _seq.split(kind)
        out[("pp", model_name, optim_name, kind)] = _seq.run(
            model_name, optim_name, ca.parallel_mode([(dim, 2), ("pipeline", 2)]), split, ca.pipeline_parallel()
        )
    groups = ca.parallel_mode([("context", 2), ("pipeline", 2)])
    out["pp_user"] = _seq.run_or_refusal("user", "sgd", groups, _seq.split("context")[1], ca.pipeline_parallel())
    return out


world4 = module_world(_world4, 4)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name,kind", TP_CASES)
def test_split_2_with_tensor_2_equals_one_process(world4, model_name, optim_name, kind):
    got = _seq.check(world4, ("tp", model_name, optim_name, kind), model_name, optim_name, ATOL, shape=HALF)
    assert "DTensor parallelize_module over the tensor dim of 2" in got["explain"]
    # the split applies to the tensor-sharded model, and its loss is reported over the ranks of other tokens
    assert got["explain"].index("tensor_parallel:") < got["explain"].index("_parallel:\n    - attention")


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name,kind,how", FSDP_CASES)
def test_split_2_with_fsdp_equals_one_process(world4, model_name, optim_name, kind, how):
    runs = [world4[rank][(how, model_name, optim_name, kind)] for rank in range(4)]
    assert all(got["shapes"][0][1] == _seq.SEQ // 2 for got in runs), [got["shapes"][0] for got in runs]
    eq.assert_equal_to_one_process(runs, _seq.reference(model_name, optim_name), ATOL)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name,kind", PP_CASES)
def test_split_2_with_pipeline_2_equals_one_process(world4, model_name, optim_name, kind):
    runs = [world4[rank][("pp", model_name, optim_name, kind)] for rank in range(4)]
    assert all(got["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2) for got in runs)
    eq.assert_stages_equal_to_one_process(runs, _seq.reference(model_name, optim_name), ATOL)  # the whole model
    got = runs[-1]
    assert "pipeline_parallel:" in got["explain"] and "checked before training" in got["explain"]


@pytest.mark.dist
def test_pipeline_with_a_model_taking_its_own_positions_is_refused(world4):
    assert "a pipeline stage calls the model's forward with the tokens" in world4[0]["pp_user"]


def _world2(rank, world):
    return {
        "ulysses_checkpoint": _seq.run(
            "llama",
            "adamw",
            ca.parallel_mode([("sequence", 2)]),
            ca.sequence_parallel(),
            ca.checkpoint("LlamaDecoderLayer"),
        )
    }


@pytest.mark.dist
def test_ulysses_with_checkpoint():
    _seq.check(run_world(_world2, 2), "ulysses_checkpoint", "llama", "adamw", ATOL)


def test_split_ordered_after_tensor_parallel():
    # mixed_parallel with a split: tests/parallel/test_sequence_gaps.py
    env = ca.Environment(world_size=4)
    plan = ca.compose(
        ca.parallel_mode([("context", 2), ("tensor", 2)]), ca.context_parallel(), ca.tensor_parallel(), env=env
    )
    assert plan.names.index("tensor_parallel") < plan.names.index("context_parallel")

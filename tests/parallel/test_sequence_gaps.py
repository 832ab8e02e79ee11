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

import _seq
import composable_atorch as ca
import equivalence as eq
from zoo.sequence import Block

from _dist import module_world

ATOL = 1e-4


CKPT_CASES = [("sgd", "context", False), ("adamw", "context", False), ("sgd", "ulysses", False)]
CKPT_CASES += [("adamw", "ulysses", False), ("adamw", "ring", False), ("sgd", "context", True)]


def _world2(rank, world):
    out = {}
    for optim_name, kind, reentrant in CKPT_CASES:
        dim, split = _seq.split(kind)
        out[(optim_name, kind, reentrant)] = _seq.run(
            "block_lm", optim_name, ca.parallel_mode([(dim, 2)]), split, ca.checkpoint(Block, reentrant=reentrant)
        )
    return out


world2 = module_world(_world2, 2)


@pytest.mark.dist
@pytest.mark.parametrize("optim_name,kind,reentrant", CKPT_CASES)
def test_split_with_checkpoint_on_a_user_model_equals_one_process(world2, optim_name, kind, reentrant):
    half = (_seq.BATCH, _seq.SEQ // 2)
    got = _seq.check(world2, (optim_name, kind, reentrant), "block_lm", optim_name, ATOL, shape=half)
    assert "2 module(s) checkpointed (Block)" in got["explain"]
    assert "recompute attends over the whole sequence" in got["explain"]


def _compare(results, key, model_name, optim_name, world):
    """Every rank's parameters (a pipeline stage's own) and losses against one process; the ranks hold
    the whole model between them."""
    runs = [results[rank][key] for rank in range(world)]
    assert all(got["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2) for got in runs), [got["shapes"] for got in runs]
    eq.assert_stages_equal_to_one_process(runs, _seq.reference(model_name, optim_name), ATOL)
    return runs[-1]


MIXED_CASES = [("llama", "sgd", "context", "tensor"), ("llama", "adamw", "ulysses", "pipeline")]
MIXED_CASES += [("llama", "adamw", "ring", "tensor")]
INTERLEAVED_CASES = [("sgd", "context"), ("adamw", "ring")]


def _world4(rank, world):
    out = {}
    for model_name, optim_name, kind, other in MIXED_CASES:
        dim, split = _seq.split(kind)
        out[("mixed", model_name, optim_name, kind)] = _seq.run(
            model_name, optim_name, ca.parallel_mode([(dim, 2), (other, 2)]), ca.mixed_parallel(), split
        )
    for optim_name, kind in INTERLEAVED_CASES:
        dim, split = _seq.split(kind)
        pp = ca.pipeline_parallel(schedule="Interleaved1F1B", stages_per_rank=2)
        out[("interleaved", optim_name, kind)] = _seq.run(
            "llama4", optim_name, ca.parallel_mode([(dim, 2), ("pipeline", 2)]), split, pp
        )
    # a context dimension without context_parallel: every context rank would train the same tokens
    groups = ca.parallel_mode([("context", 2), ("tensor", 2)])
    out["mixed_no_split"] = _seq.run_or_refusal("llama", "sgd", groups, ca.mixed_parallel())
    return out


world4 = module_world(_world4, 4)


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


world8 = module_world(_world8, 8)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name", HYBRID_CASES)
def test_context_2_with_hybrid_fsdp_equals_one_process(world8, model_name, optim_name):
    shape = (_seq.BATCH // 4, _seq.SEQ // 2)  # the batch over data 2 x zero 2
    got = _seq.check(world8, (model_name, optim_name), model_name, optim_name, ATOL, shape=shape, steps=HYBRID_STEPS)
    assert "hybrid (HSDP, 2-D mesh (data, zero))" in got["explain"]

"""context_parallel: each rank holds half of every sequence, and training equals one process
(fp32, SGD and AdamW, atol 1e-4) on a plain user model and a tiny transformers Llama, also with
data parallel and fsdp at world 4; refusals before any work."""

from __future__ import annotations

import pytest
import torch

import _seq
import composable_atorch as ca
from composable_atorch.errors import CompositionError, ConfigError
from composable_atorch.transforms.parallel.sequence.shard import chunk_positions, shard_batch

from _dist import module_world, run_world

ATOL = 1e-4
HALF = (_seq.BATCH, _seq.SEQ // 2)  # half of each sequence per rank


def test_load_balanced_chunks_cover_the_sequence_once():
    n, total = 2, 16
    got = torch.cat([chunk_positions(r, n, total // n, True) for r in range(n)])
    assert sorted(got.tolist()) == list(range(total))
    assert chunk_positions(0, 2, 8, True).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    x = torch.arange(32).view(2, 16)
    part = shard_batch((x, x + 100), 1, 2, True, "t")
    assert part[0].tolist()[0] == [4, 5, 6, 7, 8, 9, 10, 11] and part[1].shape == (2, 8)


def test_refusals_before_any_work():
    with pytest.raises(ConfigError, match="labels"):
        shard_batch({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8)}, 0, 2, True, "t")
    with pytest.raises(ConfigError, match="multiple of 4"):
        shard_batch(torch.zeros(1, 6), 0, 2, True, "t")
    env = ca.Environment.detect().with_(world_size=2)
    with pytest.raises(CompositionError, match="both split every sequence"):
        ca.compose(ca.context_parallel(), ca.sequence_parallel(), env=env)
    with pytest.raises(CompositionError, match="no 'context' dimension"):
        ca.compose(ca.context_parallel(), ca.parallel_mode([("data", 2)]), env=env)


CASES_2 = [(m, o) for m in ("user", "llama") for o in ("sgd", "adamw")]


def _world2(rank, world):  # one spawned group for the four cases
    out = {}
    for model_name, optim_name in CASES_2:
        out[(model_name, optim_name)] = _seq.run(
            model_name, optim_name, ca.parallel_mode([("context", 2)]), ca.context_parallel()
        )
    out["padded"] = _seq.run("user", "adamw", ca.parallel_mode([("context", 2)]), ca.context_parallel(), padded=True)
    # checkpointing recomputes a transformers block through the same attention interface
    out["llama_checkpoint"] = _seq.run(
        "llama", "sgd", ca.parallel_mode([("context", 2)]), ca.context_parallel(), ca.checkpoint("LlamaDecoderLayer")
    )
    # a plain user model's checkpointed blocks: tests/parallel/test_sequence_gaps.py
    return out


world2 = module_world(_world2, 2)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name", CASES_2)
def test_context_2_equals_one_process(world2, model_name, optim_name):
    got = _seq.check(world2, (model_name, optim_name), model_name, optim_name, ATOL, shape=HALF)
    assert "context_parallel(" in got["explain"] and "1/2 of every sequence" in got["explain"]
    if model_name == "llama":
        assert "attention interface" in got["explain"]


@pytest.mark.dist
def test_padded_targets_average_over_the_whole_sequence(world2):
    # rank 0's part holds every ignored target: sequence_cross_entropy sums token losses and counts over the group
    _seq.check(world2, "padded", "user", "adamw", ATOL, padded=True)


@pytest.mark.dist
def test_context_2_with_checkpoint(world2):
    _seq.check(world2, "llama_checkpoint", "llama", "sgd", ATOL)


def _world4(rank, world):
    return {
        "data": _seq.run("llama", "adamw", ca.parallel_mode([("context", 2), ("data", 2)]), ca.context_parallel()),
        "fsdp": _seq.run(
            "user", "sgd", ca.parallel_mode([("context", 2), ("data", 2)]), ca.context_parallel(), ca.fsdp()
        ),
    }


@pytest.mark.dist
def test_context_2_with_data_2_and_fsdp_at_world_4():
    results = run_world(_world4, 4)
    quarter = (_seq.BATCH // 2, _seq.SEQ // 2)
    for key, (model_name, optim_name) in {"data": ("llama", "adamw"), "fsdp": ("user", "sgd")}.items():
        _seq.check(results, key, model_name, optim_name, ATOL, shape=quarter)


def test_estimate_activations_fall_with_the_context_degree():
    from composable_atorch.estimate.core import estimate

    batch = (torch.Size([4, 256]), torch.Size([4, 256]))

    def activations(world, *transforms):
        plan = ca.compose(*transforms, env=ca.Environment(world_size=world))
        model = lambda: _seq.user_lm(max_len=256, d=64)  # noqa: E731
        result = estimate(plan, model, batch, world_size=world, device="cpu", step_time=False, criterion=_seq.seq_loss)
        return result.ranks[0].activations

    one = activations(1)
    two = activations(2, ca.parallel_mode([("context", 2)]), ca.context_parallel())
    # half of every sequence per rank; the gathered keys/values and the (q, all keys) scores stay whole-width
    assert two < 0.75 * one, (one, two)

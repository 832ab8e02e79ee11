"""pipeline_parallel at world 2 (GPipe, 1F1B, interleaved, zero-bubble) against one process.

train_step; the plain loop fails loudly.
"""

from __future__ import annotations

import copy

import pytest
import torch

import composable_atorch as ca
import equivalence as eq
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.transforms.parallel.pipeline import PipelineLoopError, balanced_cuts
from zoo.configs import llama_config

from _dist import run_world

STEPS, LR = 4, 0.1


def gpt(n_layer=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=n_layer, n_head=4))


def batches(n=STEPS, batch=8):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 256, (batch, 16), generator=g), torch.randint(0, 256, (batch, 16), generator=g))
        for _ in range(n)
    ]


def reference(model, data):
    """One process's losses (SGD)."""
    return eq.reference(model, torch.optim.SGD(model.parameters(), lr=LR), data, lm_loss)[1]


def llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(layers=4, vocab=256, max_position_embeddings=32, tie_word_embeddings=False))


def _pipeline_case(schedule, microbatches, split="auto", make=gpt, stages_per_rank=None):
    ref = make()
    model = copy.deepcopy(ref)
    data = batches()
    if make is llama:
        ref_losses = reference(eq.Logits(ref), data)
    else:
        ref_losses = reference(ref, data)
    pp = ca.pipeline_parallel(
        microbatches=microbatches, schedule=schedule, split=split, stages_per_rank=stages_per_rank
    )
    plan = ca.compose(pp, ca.parallel_mode([("pipeline", 2)]))
    model, optim, _ = plan(model, torch.optim.SGD(model.parameters(), lr=LR))
    losses = [ca.train_step(model, optim, x, y, lm_loss) for x, y in data]
    ref_p = dict(ref.named_parameters())
    mine = dict(model.named_parameters())
    held = [p for g in optim.param_groups for p in g["params"]]
    try:
        model(data[0][0])
        plain = "trained silently"
    except PipelineLoopError as exc:
        plain = str(exc)
    return {
        "loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "weight_gap": max((p.detach() - ref_p[n].detach()).abs().max().item() for n, p in mine.items()),
        "names": sorted(mine),
        "losses": losses,
        "optimizer_exact": {id(p) for p in held} == {id(p) for p in mine.values()} and len(held) == len(mine),
        "plain": plain,
        "explain": plan.explain(),
    }


def _data_mean_case(rank):
    """train_step under a DP2 plan: the same mean loss on both ranks, the one-process loss of the global batch."""
    ref = gpt(2)
    model = copy.deepcopy(ref)
    data = batches(3)
    ref_losses = reference(ref, data)  # a plain optimizer: rank-local, no collective
    model, optim, _ = ca.compose(ca.parallel_mode([("data", 2)]))(model, torch.optim.SGD(model.parameters(), lr=LR))
    half = data[0][0].size(0) // 2
    losses = [
        ca.train_step(model, optim, x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half], lm_loss)
        for x, y in data
    ]
    return {"losses": losses, "gap": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))}


def _world(rank, world):
    return {
        "gpipe": _pipeline_case("GPipe", 2),
        "1f1b": _pipeline_case("1F1B", 4),
        "1f1b_manual_split": _pipeline_case("1F1B", 2, split=(1,)),
        "llama_1f1b": _pipeline_case("1F1B", 2, make=llama),
        # several stages per rank: 4 stages of one block over 2 ranks
        "interleaved_1f1b": _pipeline_case("Interleaved1F1B", 4, stages_per_rank=2),
        "interleaved_zero_bubble": _pipeline_case("InterleavedZeroBubble", 4),
        "zbv_zero_bubble": _pipeline_case("ZBVZeroBubble", 4),
    }, _data_mean_case(rank)


@pytest.mark.dist
def test_pipeline_matches_one_process():
    got = run_world(_world, 2, timeout=600)
    ranks, means = [g[0] for g in got], [g[1] for g in got]
    # train_step's loss is the step's mean over the data dim, the same float on every rank
    assert means[0]["losses"] == means[1]["losses"], means
    assert means[0]["gap"] < 1e-5, means[0]["gap"]
    for name in ranks[0]:
        all_names = sorted(n for n, _ in (llama() if name.startswith("llama") else gpt()).named_parameters())
        r0, r1 = ranks[0][name], ranks[1][name]
        for r in (r0, r1):
            assert r["loss_gap"] < 1e-5, (name, r["loss_gap"])
            assert r["weight_gap"] < 1e-5, (name, r["weight_gap"])
            assert r["optimizer_exact"], name
            assert "train_step" in r["plain"], r["plain"]
        assert r0["losses"] == r1["losses"], (name, "non-last stages report the same mean loss")
        # the two stages hold every parameter exactly once, under the user's names
        assert sorted(r0["names"] + r1["names"]) == all_names, name
    print({n: (ranks[0][n]["loss_gap"], ranks[0][n]["weight_gap"]) for n in ranks[0]})


def test_balanced_cuts():
    assert balanced_cuts([1, 1, 1, 1], 2) == (2,)
    assert balanced_cuts([1, 1, 1, 1], 2, head=2) == (1,)  # embeddings weigh 2 blocks
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == (1,)
    assert balanced_cuts([1] * 8, 4) == (2, 4, 6)


def test_bad_configs_are_typed_errors():
    with pytest.raises(ConfigError):
        ca.pipeline_parallel(schedule="zigzag")
    with pytest.raises(ConfigError):
        ca.pipeline_parallel(microbatches=0)
    with pytest.raises(ConfigError):
        ca.pipeline_parallel(split=(2, 1))
    env = ca.Environment(world_size=2)
    with pytest.raises(ca.errors.ConflictError, match="pipeline"):
        ca.compose(ca.pipeline_parallel(), ca.parallel_mode([("data", 2)]), env=env)
    with pytest.raises(ca.errors.ConflictError):
        ca.compose(ca.pipeline_parallel(), ca.ddp(), env=env)  # the pipeline owns gradient sync
    with pytest.raises(ca.errors.ConflictError, match="microbatches"):  # the schedule is the accumulation
        ca.compose(ca.pipeline_parallel(), ca.parallel_mode([("pipeline", 2)]), ca.accumulate(2), env=env)
    with pytest.raises(ca.errors.ConflictError, match="microbatches"):
        ca.compose(ca.mixed_parallel(pipeline=2), ca.accumulate(2), env=env)
    ca.compose(ca.mixed_parallel(tensor=2), ca.accumulate(2), env=env)  # tensor x data accumulates fine
    with pytest.raises(ConfigError, match="cutter knows"):
        ca.pipeline_parallel().cuts(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)
    with pytest.raises(ConfigError, match="at least as many blocks"):  # a pipeline deeper than the model
        ca.pipeline_parallel().cuts(gpt(2), 4)
    with pytest.raises(ConfigError, match="at least as many blocks"):  # 2 ranks x 2 virtual stages > 2 blocks
        ca.pipeline_parallel(schedule="Interleaved1F1B").cuts(gpt(2), 2)
    with pytest.raises(ConfigError, match="exactly two"):
        ca.pipeline_parallel(schedule="ZBVZeroBubble", stages_per_rank=3)
    with pytest.raises(ConfigError, match="one stage per rank"):
        ca.pipeline_parallel(schedule="1F1B", stages_per_rank=2)
    with pytest.raises(ConfigError, match="at least the pipeline size"):
        ca.pipeline_parallel(schedule="1F1B", microbatches=1).cuts(gpt(4), 2)
    with pytest.raises(ca.errors.ConflictError, match="zero-bubble"):
        ca.compose(ca.pipeline_parallel(schedule="ZBVZeroBubble"), ca.compile(), env=env)
    assert "2 stages per rank" in ca.compose(ca.pipeline_parallel(schedule="Interleaved1F1B"), env=env).explain()


def test_train_step_plain_plan():
    model = gpt(2)
    plan = ca.compose(ca.checkpoint(type(model.blocks[0])))
    model, optim, _ = plan(model, torch.optim.SGD(model.parameters(), lr=LR))
    losses = [ca.train_step(model, optim, x, y, lm_loss) for x, y in batches(2)]
    assert all(isinstance(v, float) for v in losses) and losses[1] < losses[0] + 1

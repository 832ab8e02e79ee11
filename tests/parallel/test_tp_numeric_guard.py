"""tensor_parallel's numerical guard (transforms/parallel/tensor/check.py): after the plan is applied
and before any step, one probe forward through the sharded model must give the whole model's output.

The case that needed it: ``zoo.sequence.UserLM``, a fused ``qkv = nn.Linear(d, 3 * d)`` split with
``.view(b, t, 3, self.heads, -1)``, the head count fixed at init under a name the planner does not
know. Sharded (strided) at tensor 2 the local width still fits the view, as half-size heads: the
shape check passes, and it trained another model (0.35 from one process after 3 AdamW steps).
Now the planner sees the shard split into smaller heads (graph.fixed_head_reads) and keeps that
attention whole, sharding the MLPs: equal to one process. The numerical guard is the net under
whatever such a shape check misses (a softmax over a column layer's features, below): refused
with TensorPlanMismatchError before any step. Models that split right train equal, SGD and AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _seq
import composable_atorch as ca
import equivalence as eq
from composable_atorch.errors import TensorPlanMismatchError

from _dist import run_world

ATOL = 1e-4
pytestmark = pytest.mark.dist


class SoftmaxMLP(nn.Module):
    """A softmax over fc1's features: a rank's column shard normalises over its half (shapes fit)."""

    def __init__(self, vocab=256, d=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens)
        x = x + self.fc2(F.softmax(self.fc1(x), dim=-1))
        return self.head(x)


def softmax_mlp(seed: int = 0):
    torch.manual_seed(seed)
    return SoftmaxMLP()


def _train(rank, world, model_name, optim_name, plan):
    _seq.MODELS["softmax"] = softmax_mlp
    try:
        got = _seq.run(model_name, optim_name, ca.parallel_mode([("tensor", 2)]), ca.tensor_parallel(plan))
    except TensorPlanMismatchError as e:
        return {"refused": str(e)}
    return {**got, "refused": None}


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_fused_qkv_with_fixed_heads_kept_whole_trains_equal(optim_name):
    got = run_world(_train, 2, "user", optim_name, "auto")[0]
    assert got["refused"] is None, got["refused"]
    assert "smaller heads, not fewer" in got["explain"] and "blocks.0.qkv" in got["explain"], got["explain"]
    assert "sharded output checked against the whole model" in got["explain"], got["explain"]
    params, losses = eq.gaps(got, _seq.reference("user", optim_name))
    assert params < ATOL and losses < ATOL, (params, losses)


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_manual_plan_keeping_the_fused_layer_whole_trains_equal(optim_name):
    plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
    got = run_world(_train, 2, "user", optim_name, plan)[0]
    assert got["refused"] is None
    assert "sharded output checked against the whole model" in got["explain"], got["explain"]
    params, losses = eq.gaps(got, _seq.reference("user", optim_name))
    assert params < ATOL and losses < ATOL, (params, losses)


def test_guard_passes_llama():
    got = run_world(_train, 2, "llama", "adamw", "auto")[0]
    assert got["refused"] is None
    assert "sharded output checked against the whole model" in got["explain"], got["explain"]
    params, losses = eq.gaps(got, _seq.reference("llama", "adamw"))
    assert params < ATOL and losses < ATOL, (params, losses)


def test_manual_plan_with_fixed_heads_is_refused_at_planning():
    plan = ca.tensor_parallel(ca.TPInfo().shard_col({"qkv": {"stride": 3}}).shard_row("o"))
    with pytest.raises(ca.errors.ConfigError, match="smaller heads, not fewer"):
        plan.check(_seq.user_lm(), 2)


def test_guard_refuses_what_the_shapes_miss_before_any_step():
    got = run_world(_train, 2, "softmax", "sgd", "auto")[0]
    msg = got["refused"]
    assert msg is not None and "differs from the whole model's" in msg and "fc1" in msg and "Fix:" in msg, msg

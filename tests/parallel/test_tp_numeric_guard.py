"""tensor_parallel's numerical guard (transforms/parallel/tensor/check.py): after the plan is applied
and before any step, one probe forward through the sharded model must give the whole model's output.

The case that needed it: ``_seq.UserLM``, a fused ``qkv = nn.Linear(d, 3 * d)`` split with
``.view(b, t, 3, self.heads, -1)``, the head count fixed at init under a name the planner does not
know. Sharded (strided) at tensor 2 the local width still fits the view, as half-size heads: the
shape check passes, and it trained another model (0.35 from one process after 3 AdamW steps).
The guard refuses it (TensorPlanMismatchError) or the plan handles it, never a silent wrong run;
and models whose heads are read from the width train equal to one process, SGD and AdamW."""

from __future__ import annotations

import pytest

import _seq
import composable_atorch as ca
from composable_atorch.errors import TensorPlanMismatchError

from _dist import run_world

ATOL = 1e-4
pytestmark = pytest.mark.dist


def _train(rank, world, model_name, optim_name, plan):
    try:
        got = _seq.run(model_name, optim_name, ca.parallel_mode([("tensor", 2)]), ca.tensor_parallel(plan))
    except TensorPlanMismatchError as e:
        return {"refused": str(e)}
    return {**got, "refused": None}


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_fused_qkv_with_fixed_heads_never_trains_silently_wrong(optim_name):
    got = run_world(_train, 2, "user", optim_name, "auto")[0]
    if got["refused"] is not None:  # refused before any step, naming the fused layer and the fix
        msg = got["refused"]
        assert "blocks.0.qkv" in msg and "Fix:" in msg and "keep that layer whole" in msg, msg
        return
    params, losses = _seq.close(got, _seq.reference("user", optim_name))
    assert params < ATOL and losses < ATOL, (params, losses)


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_manual_plan_keeping_the_fused_layer_whole_trains_equal(optim_name):
    plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
    got = run_world(_train, 2, "user", optim_name, plan)[0]
    assert got["refused"] is None
    assert "sharded output checked against the whole model" in got["explain"], got["explain"]
    params, losses = _seq.close(got, _seq.reference("user", optim_name))
    assert params < ATOL and losses < ATOL, (params, losses)


def test_guard_passes_llama():
    got = run_world(_train, 2, "llama", "adamw", "auto")[0]
    assert got["refused"] is None
    assert "sharded output checked against the whole model" in got["explain"], got["explain"]
    params, losses = _seq.close(got, _seq.reference("llama", "adamw"))
    assert params < ATOL and losses < ATOL, (params, losses)

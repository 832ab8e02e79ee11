"""ATorch's sequence_parallel (Ulysses): each rank holds half of every sequence, attention runs on
half of the heads after an all-to-all, and training equals one process (fp32, SGD and AdamW, atol
1e-4) on a plain user model and a tiny transformers Llama, also through ATorch's load_strategy;
Megatron-style sequence parallelism stays tensor_parallel(sequence_parallel=True)."""

from __future__ import annotations

import pytest
import torch

import _seq
import composable_atorch as ca
import equivalence as eq
from composable_atorch.core.transform import lookup
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.sequence import Ulysses
from composable_atorch.transforms.parallel.sequence.attention import Attend
from composable_atorch.transforms.parallel.tensor import TensorParallel

from _dist import module_world

ATOL = 1e-4
SP = ("sequence_parallel", {"sp_size": 2, "batch_sp_processing_fn": lambda batch: batch})


def test_atorch_name_is_ulysses_and_megatron_stays_in_tensor_parallel():
    assert lookup("sequence_parallel") is Ulysses and lookup("ulysses") is Ulysses
    assert ca.tensor_parallel(sequence_parallel=True).sequence_parallel is True
    assert isinstance(TensorParallel.from_seed({"sequence_parallel": True}), TensorParallel)
    env2, env4 = ca.Environment(world_size=2), ca.Environment(world_size=4)
    plan = ca.strategy.load([("parallel_mode", None), SP], env=env2)
    assert dict(plan.transforms[0].groups) == {"sequence": 2, "data": 1} and "sequence_parallel" in plan.names
    assert "Ulysses" in plan.explain() and "sp_size 2" in plan.explain()
    plan = ca.strategy.load([("parallel_mode", ([("data", 4)], None)), SP], env=env4)
    assert dict(plan.transforms[0].groups) == {"sequence": 2, "data": 2}  # independent of the data group
    assert dict(ca.strategy.load([SP], env=env2).transforms[0].groups) == {"sequence": 2, "data": 1}
    with pytest.raises(ConfigError, match="sequence size 2"):
        ca.strategy.load(
            [("parallel_mode", ([("sequence", 2), ("data", 2)], None)), ("sequence_parallel", {"sp_size": 4})],
            env=env4,
        )
    mixed = ca.compose(ca.sequence_parallel(), ca.mixed_parallel(), env=env4)  # it expands around the split
    assert mixed.names == ("parallel_mode", "sequence_parallel", "ddp") and mixed.requested[0].name == "mixed_parallel"
    assert "sequence_parallel" not in ca.strategy.load([SP], env=ca.Environment(world_size=1)).names


def test_heads_not_divisible_is_a_config_error():
    attend = Attend(kind="ulysses", group=None, rank=0, n=2, who="sequence_parallel")
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ConfigError, match="multiple of the sequence size 2"):
        attend(q, q, q, causal=True)


CASES = [(m, o) for m in ("user", "llama") for o in ("sgd", "adamw")] + [("llama_mqa", "sgd")]


def _world2(rank, world):  # one spawned group for every case
    out = {key: _seq.run(*key, ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel()) for key in CASES}
    out["strategy"] = _seq.run("llama", "sgd", strategy=[("parallel_mode", None), SP])
    out["auto_accelerate"] = _auto_accelerate()
    return out


def _auto_accelerate():
    """ATorch's auto_accelerate with load_strategy=[parallel_mode, sequence_parallel sp_size 2], its own loop."""
    from composable_atorch.data import TextDataset

    status, result, best = ca.auto_accelerate(
        _seq.llama(),
        optim_func=torch.optim.SGD,
        dataset=TextDataset(_seq.SEQ, limit=4 * _seq.BATCH),
        loss_func=lambda batch, output: _seq.seq_loss(output, batch[1]),
        optim_args={"lr": 0.5},
        dataloader_args={"batch_size": _seq.BATCH},
        load_strategy=[("parallel_mode", None), SP],
        ignore_dryrun_on_load_strategy=True,
    )
    losses, shapes = [], []
    for _, batch in zip(range(_seq.STEPS), result.dataloader, strict=False):
        batch = result.prepare_input(batch, "cpu")
        shapes.append(tuple(batch[0].shape))
        loss = result.loss_func(batch, result.model(batch[0]))
        loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(loss.item())
    params = {k: v.numpy() for k, v in eq.full_params(result.model).items()}
    return {"status": status, "params": params, "losses": losses, "shapes": shapes, "explain": best.explain()}


world2 = module_world(_world2, 2)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name", CASES)
def test_ulysses_2_equals_one_process(world2, model_name, optim_name):
    half = (_seq.BATCH, _seq.SEQ // 2)  # half of each sequence per rank
    got = _seq.check(world2, (model_name, optim_name), model_name, optim_name, ATOL, shape=half)
    assert "1/2 of the heads" in got["explain"]


@pytest.mark.dist
@pytest.mark.parametrize("how", ["strategy", "auto_accelerate"])
def test_atorch_load_strategy_runs_ulysses(world2, how):
    ref = _seq.reference("llama", "sgd")
    for rank in (0, 1):
        got = world2[rank][how]
        assert got["shapes"][0] == (_seq.BATCH, _seq.SEQ // 2)
        # auto_accelerate's loss is the rank's own (its part of each sequence), the parameters the whole model's
        dp, dl = eq.gaps(got, ref)
        assert dp < ATOL and (dl < ATOL or how == "auto_accelerate"), (dp, dl)
        assert "parallel_mode(sequence 2 x data 1)" in got["explain"]

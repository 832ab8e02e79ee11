"""ddp / zero1 / zero2 / fsdp on a real gloo group of 2: numerics against plain PyTorch and each other.

All world-2 cases run inside one spawned group (spawning costs seconds); the parent compares.
Tolerances: ddp vs one process 1e-4 after 5 AdamW steps (the all-reduce sums in another order);
fsdp and zero2 (FSDP2) equal ddp bitwise (measured); zero1, fairscale zero2 and fsdp with an
ignored module (whose gradients are averaged by hand) within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.models import Block
from composable_atorch.transforms.loop import ClipHook
from equivalence import bitwise, full_params, max_diff, plain

from _dist import module_world
from _dp import BATCH, STEPS, loader, model, reference, run_plan, train

pytestmark = pytest.mark.dist


class EvenFirstSampler(DistributedSampler):
    """A user's distributed sampler class (same interface as DistributedSampler)."""


def _ranks_agree(params: dict) -> dict:
    """Each rank's parameters' checksum, to check ranks hold the same model."""
    return {k: float(v.double().sum()) for k, v in params.items()}


def _count_allreduce(m) -> list[int]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    m.register_comm_hook(dist.group.WORLD, hook)
    return calls


def world2_cases(rank: int, world: int) -> dict:
    out: dict = {}
    out["reference"], out["reference_losses"] = reference()
    runs = {
        "ddp": (ca.ddp(),),
        "parallel_mode": (ca.parallel_mode(),),
        "fsdp": (ca.fsdp(wrap=(Block,)),),
        "fsdp_min_params": (ca.fsdp(min_params=1000),),
        "zero2": (ca.zero2(),),
        "fsdp_ignored": (ca.fsdp(wrap=(Block,), ignored=("ln_f",)),),
        "zero1_torch": (ca.zero1(),),
        "zero1_fairscale": (ca.zero1(backend="fairscale"),),
        "zero2_fairscale": (ca.zero2(backend="fairscale"),),
    }
    for key, transforms in runs.items():
        r = run_plan(*transforms)
        out[key] = r["params"]
        out[key + "_explain"] = r["explain"]
        out[key + "_checksum"] = _ranks_agree(r["params"])
        if key == "ddp":
            out["ddp_per_rank_batch"] = r["loader"].batch_size
            out["ddp_sampler"] = type(r["loader"].sampler).__name__
        if key == "zero1_torch":
            opt = r["optim"].optimizer
            out["zero1_local_state_numel"] = sum(
                t.numel() for s in opt.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
            )

    # accumulate: 2 micro-batches of 2 per rank per step; all-reduce only on the boundary
    m, opt = model(), None
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m, opt, data = ca.compose(ca.ddp(), ca.accumulate(2))(m, opt, loader())
    calls = _count_allreduce(m)
    train(m, opt, data)
    out["accumulate"] = full_params(m)
    out["accumulate_allreduce_calls"] = calls[0]
    out["accumulate_micro_batch"] = data.batch_size
    # the same with ddp alone: one all-reduce per step
    m, opt = model(), None
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m, opt, data = ca.compose(ca.ddp())(m, opt, loader())
    calls = _count_allreduce(m)
    train(m, opt, data)
    out["ddp_allreduce_calls"] = calls[0]
    # accumulate under fsdp equals accumulate under ddp
    r = run_plan(ca.fsdp(wrap=(Block,)), ca.accumulate(2))
    out["fsdp_accumulate"] = r["params"]

    # clip_grad under fsdp (sharded DTensor grads) vs under ddp vs one process
    for key, transforms in {
        "clip_ddp": (ca.ddp(),),
        "clip_fsdp": (ca.fsdp(wrap=(Block,)),),
        "clip_zero2_fairscale": (ca.zero2(backend="fairscale"),),
    }.items():
        r = run_plan(*transforms, ca.clip_grad(0.05))
        out[key] = r["params"]
        norm = next(r["optim"].hook(ClipHook)).last_norm
        out[key + "_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    out["clip_reference"], _ = reference(clip=0.05)

    # fsdp | amp | checkpoint trains; mixed-precision policy from amp shows in explain()
    r = run_plan(ca.fsdp(wrap=(Block,)), ca.amp("bf16"), ca.checkpoint(Block))
    out["fsdp_amp_ckpt_losses"], out["fsdp_amp_ckpt_explain"] = r["losses"], r["explain"]
    out["fsdp_amp_ckpt_finite"] = r["finite"]
    out["fsdp_amp_ckpt_diff"] = max_diff(r["params"], out["ddp"])

    # fp16 loss scaling on sharded grads: an inf on one rank's shard skips the step on every rank
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m, opt, data = ca.compose(ca.fsdp(wrap=(Block,)), ca.amp("fp16"))(m, opt, loader())
    before = {k: v.clone() for k, v in full_params(m).items()}

    def poison(mm):
        if rank == 0:
            next(iter(mm.parameters())).grad.to_local().view(-1)[0] = float("inf")

    train(m, opt, data, steps=1, on_grads=poison)
    out["fp16_inf_skipped_everywhere"] = bitwise(before, full_params(m))
    train(m, opt, data, steps=1)
    out["fp16_next_step_moves"] = not bitwise(before, full_params(m))

    # bf16 skip_if_nonfinite on sharded grads: a nan in one rank's shard skips the step everywhere
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m, opt, data = ca.compose(ca.fsdp(wrap=(Block,)), ca.amp("bf16", skip_if_nonfinite=True))(m, opt, loader())
    before = {k: v.clone() for k, v in full_params(m).items()}

    def poison_nan(mm):
        if rank == 1:
            list(mm.parameters())[-1].grad.to_local().view(-1)[0] = float("nan")

    train(m, opt, data, steps=1, on_grads=poison_nan)
    out["bf16_nan_skipped_everywhere"] = bitwise(before, full_params(m))

    # loader: a user's sampler class and shuffle are kept; a batch that does not split is a ConfigError
    _, _, data = ca.compose(ca.parallel_mode(distributed_sampler_cls=EvenFirstSampler), ca.ddp())(
        model(), None, loader(shuffle=True)
    )
    out["custom_sampler"] = (
        type(data.sampler).__name__,
        data.sampler.shuffle,
        data.sampler.num_replicas,
        data.sampler.rank,
    )
    try:
        ca.compose(ca.ddp())(model(), None, loader(batch=7))
        out["odd_batch_error"] = None
    except ConfigError as exc:
        out["odd_batch_error"] = str(exc)
    return plain(out)


world2 = module_world(world2_cases, 2, timeout=600)


def test_ddp_matches_one_process_on_the_same_global_batches(world2):
    for r in world2:
        assert max_diff(r["ddp"], r["reference"]) < 1e-4
        assert r["ddp_per_rank_batch"] == BATCH // 2 and r["ddp_sampler"] == "DistributedSampler"
    assert world2[0]["ddp_checksum"] == world2[1]["ddp_checksum"]


def test_parallel_mode_alone_trains_with_ddp(world2):
    r = world2[0]
    assert "implied ddp" in r["parallel_mode_explain"]
    assert bitwise(r["parallel_mode"], r["ddp"])


@pytest.mark.parametrize("key", ["fsdp", "fsdp_min_params", "zero2"])
def test_fsdp2_variants_equal_ddp_bitwise(world2, key):
    for r in world2:
        assert bitwise(r[key], r["ddp"]), f"{key}: max diff {max_diff(r[key], r['ddp'])}"


@pytest.mark.parametrize("key", ["zero1_torch", "zero1_fairscale", "zero2_fairscale", "fsdp_ignored"])
def test_zero_backends_match_ddp(world2, key):
    for r in world2:
        assert max_diff(r[key], r["ddp"]) <= 1e-6
    assert world2[0][key + "_checksum"] == world2[1][key + "_checksum"]


def test_zero1_keeps_only_its_shard_of_the_optimizer_state(world2):
    total = sum(p.numel() for p in model().parameters()) * 2  # AdamW: exp_avg + exp_avg_sq
    local = [r["zero1_local_state_numel"] for r in world2]
    assert sum(local) == total and all(0 < n < total for n in local)


def test_accumulate_skips_allreduce_between_boundaries_and_matches_ddp(world2):
    for r in world2:
        assert r["ddp_allreduce_calls"] == STEPS
        assert r["accumulate_allreduce_calls"] == STEPS  # 2 * STEPS backwards, STEPS all-reduces
        assert r["accumulate_micro_batch"] == BATCH // 2 // 2
        assert max_diff(r["accumulate"], r["ddp"]) < 1e-4  # micro-batch sums reorder the reduction
        assert max_diff(r["fsdp_accumulate"], r["accumulate"]) < 1e-6


def test_clip_grad_clips_the_global_norm_of_sharded_gradients(world2):
    for r in world2:
        assert r["clip_ddp_norm"] > 0.05  # clipping really happened
        assert abs(r["clip_fsdp_norm"] - r["clip_ddp_norm"]) < 1e-6
        assert abs(r["clip_zero2_fairscale_norm"] - r["clip_ddp_norm"]) < 1e-6
        assert max_diff(r["clip_fsdp"], r["clip_ddp"]) < 1e-6
        assert max_diff(r["clip_zero2_fairscale"], r["clip_ddp"]) < 1e-5  # same norm, summed in another order
        assert max_diff(r["clip_ddp"], r["clip_reference"]) < 1e-4


def test_fsdp_amp_checkpoint_trains(world2):
    r = world2[0]
    assert r["fsdp_amp_ckpt_finite"] and r["fsdp_amp_ckpt_losses"][-1] < r["fsdp_amp_ckpt_losses"][0]
    assert "mixed precision from amp" in r["fsdp_amp_ckpt_explain"]
    assert r["fsdp_amp_ckpt_diff"] < 5e-2  # bf16 forward vs fp32 ddp, 5 steps at lr 1e-2


def test_fp16_scaler_skips_on_every_rank_when_one_shard_overflows(world2):
    for r in world2:
        assert r["fp16_inf_skipped_everywhere"] and r["fp16_next_step_moves"]


def test_bf16_skip_if_nonfinite_agrees_across_ranks(world2):
    assert all(r["bf16_nan_skipped_everywhere"] for r in world2)


def test_loader_sampler_and_batch_checks(world2):
    for rank, r in enumerate(world2):
        assert r["custom_sampler"] == ("EvenFirstSampler", True, 2, rank)
        assert (
            "loader batch_size" in r["odd_batch_error"]
            and "multiple of the data-parallel size 2" in r["odd_batch_error"]
        )

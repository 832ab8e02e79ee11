"""The step-time model: its calibration cache, its pricing on synthetic calibrations, and the
block-deduplicated estimate (no timing assertions: the calibrations here are made up)."""

from __future__ import annotations

import json

import pytest
import torch

import composable_atorch as ca
from composable_atorch.auto.workload import GPTTask
from composable_atorch.estimate import calibrate, estimate, kernels
from composable_atorch.estimate.calibrate import Calibration, CalibrationError, Curve
from composable_atorch.estimate.steptime import OpTrace
from composable_atorch.models import Block

TASK = GPTTask(seq_len=32, d_model=32, n_layer=2, n_head=4, batch_size=8)
DEEP = GPTTask(seq_len=32, d_model=32, n_layer=5, n_head=4, batch_size=8)  # 5 blocks: deeper than dedup's depths
#: seconds per unit of each curve's size: every op costs exactly its FLOPs or bytes times this
RATE = {"mm": 1e-9, "sdpa": 1e-9, "memory": 1e-10, "comm": 1e-8}


def synthetic(per_op: float = 1e-6) -> Calibration:
    """A linear machine: time = size x rate, so sums of sizes can be read back from the times."""
    curves = {}
    for name in calibrate.CURVES:
        rate = RATE.get(name.split("_")[0], RATE["comm"])
        curves[name] = [[1.0, rate], [1e12, rate * 1e12]]
    return Calibration.from_dict({"version": calibrate.VERSION, "per_op_s": per_op, "curves": curves})


def est(plan, task=TASK, **kw):
    shape = torch.Size([task.batch_size, task.seq_len])
    kw.setdefault("calibration", synthetic())
    return estimate(
        plan, task.model, (shape, shape), world_size=2, device="cpu", loss_fn=task.loss, optimizer=task.optimizer, **kw
    )


def test_calibration_round_trips_and_refuses_corrupt_files(tmp_path, monkeypatch):
    cal = synthetic(3e-6)
    path = tmp_path / "cal.json"
    calibrate.save(cal, path)
    assert calibrate.load(path).to_dict() == cal.to_dict()
    for bad in ("{not json", json.dumps({"version": 999}), json.dumps({**cal.to_dict(), "per_op_s": -1})):
        path.write_text(bad)
        with pytest.raises(CalibrationError, match="recalibrate=True"):
            calibrate.load(path)
    broken = cal.to_dict()
    broken["curves"]["all_gather"] = [[1, "fast"]]
    path.write_text(json.dumps(broken))
    with pytest.raises(CalibrationError, match="all_gather"):
        calibrate.load(path)
    # calibration() measures again over a corrupt file (measuring stubbed: it takes ~15 s) and rewrites it
    measured = []
    monkeypatch.setattr(calibrate, "measure", lambda threads=1: measured.append(threads) or synthetic(5e-6))
    assert calibrate.calibration(path=path).per_op_s == 5e-6 and measured == [1]
    assert calibrate.load(path).per_op_s == 5e-6
    assert calibrate.calibration(path=path, recalibrate=True).per_op_s == 5e-6 and measured == [1, 1]


def test_curve_floor_interpolation_and_monotone():
    c = Curve.of([[10, 2.0], [20, 1.0], [30, 6.0]])  # a noisy middle point never makes a larger op cheaper
    assert c(5) == 2.0 and c(15) == 2.0 and c(25) == 4.0 and c(60) == 12.0


def test_more_flops_take_more_time():
    cal = synthetic()
    times = []
    for n in (16, 32, 64):
        trace = OpTrace()
        with trace:
            torch.randn(n, n) @ torch.randn(n, n)
        assert trace.flops() == 2 * n**3
        times.append(trace.price(cal)["compute"])
    assert times[0] < times[1] < times[2]


def test_checkpoint_recomputes_and_ddp_all_reduces_the_gradients():
    plain, ddp, ckpt = est(ca.fsdp(wrap=Block)), est(ca.ddp()), est(ca.ddp() | ca.checkpoint(Block))
    for e in (plain, ddp, ckpt):
        assert e.step_time is not None and e.step_time_s == pytest.approx(e.step_time.seconds)
        assert e.step_time.compute > 0 and e.step_time.overhead > 0
    # the recomputed forward: more FLOPs and more compute than the same plan without checkpointing
    assert ckpt.flops > ddp.flops and ckpt.step_time.compute > ddp.step_time.compute
    # DDP's all-reduce (not run in the fake world) is the gradients' bytes: world 2 reads the curve as is
    grad_bytes = sum(p.numel() * p.element_size() for p in TASK.model().parameters())
    assert ddp.step_time.comm == pytest.approx(grad_bytes * RATE["comm"], rel=1e-9)
    assert plain.step_time.comm > 0  # FSDP's all-gathers and reduce-scatters are traced


def test_block_dedup_gives_the_full_estimate():
    # extrapolated (the peak keeps its phase from 2 to 4 blocks): the very bytes, FLOPs and seconds
    for plan in (ca.fsdp(wrap=Block) | ca.amp("bf16"), ca.zero2(wrap=Block) | ca.checkpoint(Block)):
        full, fast = est(plan, DEEP, dedup=False), est(plan, DEEP, dedup=True)
        assert any("extrapolated per block" in n for n in fast.notes), fast.notes
        assert not any("identical blocks" in n for n in full.notes)
        assert fast.ranks == full.ranks
        assert fast.flops == full.flops
        # seconds: equal but for ops over the whole model whose size grows with the block count (the
        # non-finite check stacks one flag per gradient): priced on a size curve, not linear in blocks
        assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-6)
    # DDP's buckets span blocks: the whole model is simulated
    assert any("buckets span blocks" in n for n in est(ca.ddp(), DEEP, dedup=True).notes)


def test_search_skips_only_plans_predicted_to_lose_by_more_than_the_error():
    from composable_atorch.auto.predict import Prediction, StepTimeCheck
    from composable_atorch.auto.trial import TrialResult

    def ok(step):
        return TrialResult("ok", samples_per_s=16 / step, step_time=step)

    check = StepTimeCheck(min_error=0.1)
    check.observe(Prediction(1, step_time_s=0.5), ok(1.0))
    assert check.loses(Prediction(1, step_time_s=5.0)) is None  # one trial tells no error: nothing skipped yet
    check.observe(Prediction(1, step_time_s=0.25), ok(0.6))  # ratios 2.0 and 2.4: scale 2.4, error 1/6
    assert check.scale == pytest.approx(2.4) and check.error == pytest.approx(1 / 6)
    assert check.loses(Prediction(1, step_time_s=0.27)) is None  # 0.648 s: within the error of the best 0.6 s
    assert "slower than the best measured" in check.loses(Prediction(1, step_time_s=0.4))  # 0.96 s
    assert check.loses(Prediction(1)) is None  # no step time predicted: measured
    # the estimate failed (a simulated step that cannot run, as the plans that crash do): not run
    failed = Prediction(reason="EstimateError: one training step of the plan cannot run on fake tensors")
    assert "no step-time prediction (EstimateError" in check.loses(failed)
    assert StepTimeCheck().loses(failed) is None  # before the model is held to any trial: measured
    assert "+140%" in check.pick_note(Prediction(1, step_time_s=0.25), ok(0.6))
    # trials in bf16 say nothing about the model's error in fp32: an fp32 plan is not skipped on them
    bf16 = StepTimeCheck(min_error=0.1)
    bf16.observe(Prediction(1, step_time_s=0.1, precision="bf16"), ok(0.2))
    bf16.observe(Prediction(1, step_time_s=0.1, precision="bf16"), ok(0.21))
    assert "bf16 trials" in bf16.loses(Prediction(1, step_time_s=0.2, precision="bf16"))  # 0.4 s vs 0.2 s
    assert bf16.loses(Prediction(1, step_time_s=0.2)) is None  # fp32: no trial in its dtype yet
    bf16.observe(Prediction(1, step_time_s=0.2), ok(0.19))  # fp32 measured: its own scale, ~0.95
    assert bf16.loses(Prediction(1, step_time_s=0.18)) is None and "fp32 trials" in bf16.loses(
        Prediction(1, step_time_s=0.5)
    )
    # before any trial, a plan is held only to the predictions of its own dtype
    others = [Prediction(1, step_time_s=0.1, precision="bf16"), Prediction(1, step_time_s=0.3)]
    assert StepTimeCheck().loses_unmeasured(Prediction(1, step_time_s=0.25), others) is None  # fastest fp32
    assert "slower than the fastest predicted" in StepTimeCheck().loses_unmeasured(
        Prediction(1, step_time_s=0.2, precision="bf16"), others
    )


def test_a_plan_predicts_in_the_dtype_of_its_matmuls():
    from composable_atorch.auto.predict import compute_precision

    env = ca.Environment.detect()
    assert compute_precision(ca.compose(env=env)) == "fp32"
    assert compute_precision(ca.compose(ca.amp("bf16"), env=env)) == "bf16"
    assert compute_precision(ca.compose(ca.half("fp16"), env=env)) == "fp16"


def test_the_attention_backward_has_its_own_curve_and_older_calibrations_fall_back():
    """The CPU's attention backward costs several times the forward per FLOP: traced as its own kind,
    priced on its own curve where the calibration has one, else on the forward's (older files load)."""
    from composable_atorch.estimate.steptime import price_op

    q = torch.randn(2, 2, 16, 8, requires_grad=True)
    trace = OpTrace()
    with trace:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    kinds = {kind for kind, _, _ in trace.ops}
    assert {"sdpa", "sdpa_bwd"} <= kinds
    bwd = next(size for kind, _, size in trace.ops if kind == "sdpa_bwd")
    old = synthetic()
    assert "sdpa_bwd_float32" not in old.curves
    assert price_op(old, "sdpa_bwd", "float32", bwd) == pytest.approx(bwd * RATE["sdpa"])
    slow = old.to_dict()
    slow["curves"]["sdpa_bwd_float32"] = [[1.0, 4e-9], [1e12, 4e-9 * 1e12]]
    assert price_op(Calibration.from_dict(slow), "sdpa_bwd", "float32", bwd) == pytest.approx(4 * bwd * RATE["sdpa"])
    assert trace.flops() >= bwd


def test_zero1s_broadcasts_have_their_own_curve_and_older_calibrations_price_them_as_all_gathers():
    """ZeRO-1 broadcasts every updated parameter from its owner: many small collectives, whose floor on
    the all-gather curve priced them at 3x what they took here; priced on the broadcast curve where
    the calibration measured one."""
    old = synthetic()
    assert "broadcast" not in old.curves
    by_all_gather = est(ca.zero1(), calibration=old).step_time.comm
    slow = old.to_dict()
    slow["curves"]["broadcast"] = [[1.0, 3 * RATE["comm"]], [1e12, 3 * RATE["comm"] * 1e12]]
    by_broadcast = est(ca.zero1(), calibration=Calibration.from_dict(slow)).step_time.comm
    ddp = est(ca.ddp(), calibration=old).step_time.comm  # the gradients' all-reduce, which zero1 also runs
    assert by_broadcast - ddp == pytest.approx(3 * (by_all_gather - ddp)) and by_all_gather > ddp


def here(cal: Calibration, **machine) -> Calibration:
    """``cal`` as a replay calibration measured on this machine (or one with ``machine`` changed)."""
    data = cal.to_dict() | {"replay": True, "machine": calibrate.machine_facts(1) | machine}
    return Calibration.from_dict(data)


def test_replay_is_used_only_by_a_replay_calibration_of_this_cpu():
    cal = synthetic()
    assert not cal.replays_here()  # recorded / made-up calibrations price by their curves (tests stay exact)
    assert here(cal).replays_here()
    assert Calibration.from_dict(here(cal).to_dict()).replay  # the flag survives the JSON round trip
    assert not here(cal, host="another-host").replays_here()
    assert not here(cal, torch="0.0").replays_here()


def test_replayed_kernels_replace_their_curve_price(monkeypatch):
    """Each eager kernel re-run here costs what it took (a stub here: no timing) instead of its curve;
    collectives and the framework's per-op cost are untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    trace = OpTrace()
    with trace:
        model(torch.randn(8, 16)).sum().backward()
    cal = here(synthetic())
    by_curve = trace.price(cal, replay=False)
    assert trace.replays and sum(trace.replays.values()) == trace.op_count
    took = {}
    monkeypatch.setattr(kernels, "replay_seconds", lambda func, spec, threads=1: took.setdefault(str(func), 1e-3))
    replayed = trace.price(cal)
    assert "aten.gelu_backward.default" in took and "aten.mm.default" in took
    assert replayed["compute"] == pytest.approx(1e-3 * trace.op_count)
    assert replayed["overhead"] == by_curve["overhead"] and replayed["comm"] == by_curve["comm"]
    # an op that cannot be re-run (None) keeps its curve price
    monkeypatch.setattr(kernels, "replay_seconds", lambda func, spec, threads=1: None)
    assert trace.price(cal) == pytest.approx(by_curve)


def test_replay_reruns_an_op_at_its_shapes_and_remakes_strided_and_index_arguments():
    x = torch.randn(4, 1).expand(4, 8)  # stride 0: remade without writing one element twice
    spec = kernels.op_spec((x, 0, torch.tensor([2, 3, 1])), {})
    tree, leaves = spec
    assert leaves[0] == ("tensor", (4, 8), (1, 0), torch.float32) and leaves[2][3] == torch.int64
    seconds = kernels.replay_seconds(torch.ops.aten.index_select.default, spec)
    assert seconds is not None and seconds > 0
    assert kernels.replay_seconds(torch.ops.aten.index_select.default, spec) == seconds  # memoised
    assert kernels.op_spec((torch.ones(2), object()), {}) is None  # e.g. a process group: not remade
    bad = kernels.op_spec((torch.ones(2, 3), torch.ones(5, 7)), {})
    assert kernels.replay_seconds(torch.ops.aten.mm.default, bad) is None  # cannot run: its curve prices it


def test_replay_times_an_op_over_argument_copies_that_outgrow_the_last_level_cache():
    """Each call reads tensors the other calls pushed out of the cache, as in a training step (the
    op's tensors last touched many ops before); a tiny op's copies stay few enough to fit a core's cache."""
    llc = kernels.last_level_cache_bytes()
    assert llc > 0
    for nbytes in (2**16, 2**20, 2**23):
        copies = kernels.replay_copies(nbytes)
        assert copies * nbytes >= 2 * llc or copies == kernels.REPLAY_MAX_COPIES
    assert kernels.replay_copies(4 * llc) == 1 and kernels.replay_copies(8) == kernels.REPLAY_MAX_COPIES
    x = torch.randn(4, 1).expand(4, 8)
    remade = kernels._remade(kernels.op_spec((x,), {})[1][0], 3)
    assert [t.stride() for t in remade] == [(1, 0)] * 3  # each keeps the traced layout
    assert len({t.untyped_storage().data_ptr() for t in remade}) == 3  # over its own storage
    assert all(torch.equal(t, remade[0]) for t in remade)


def test_block_dedup_gives_the_full_estimate_when_replaying(monkeypatch):
    """The deduplicated estimate extrapolates the replayed calls too: equal to the full simulation."""
    monkeypatch.setattr(kernels, "replay_seconds", lambda func, spec, threads=1: 1e-4 * (1 + len(str(func)) % 7))
    plan = ca.ddp() | ca.checkpoint(Block)
    full = est(plan, DEEP, calibration=here(synthetic()), dedup=False)
    short = est(plan, DEEP, calibration=here(synthetic()), dedup=True)
    assert short.step_time_s == pytest.approx(full.step_time_s, rel=1e-6)

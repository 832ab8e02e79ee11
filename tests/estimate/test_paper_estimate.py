"""estimate(..., hardware=, nodes=) on paper, the CLI's --json names, and the GPU calibration's CPU-testable
parts (issue 37, items 3 and 6). Small models: a few seconds each, no spawned worlds."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.estimate import estimate
from composable_atorch.estimate.calibrate import Calibration, CalibrationError, calibration, load, save
from composable_atorch.estimate.paper import calibrate as gpu
from composable_atorch.hardware import HardwareError, get

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=256,
)
KEYS = ("step_time_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "hfu", "peak_bytes", "fits")


def build():
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))


def batch(n=16, seq=128):
    shape = torch.Size([n, seq])
    return {"input_ids": shape, "labels": shape}


def fsdp_plan():
    return ca.fsdp(wrap=LlamaDecoderLayer) | ca.amp("bf16") | ca.checkpoint(LlamaDecoderLayer)


@pytest.fixture(scope="module")
def on_h100():
    return estimate(fsdp_plan(), build, batch(), world_size=8, device="cuda", hardware="h100-sxm", dedup=False)


def test_paper_fields(on_h100):
    est = on_h100
    d = est.to_dict()
    assert all(d[k] is not None for k in KEYS)
    assert d["hardware"] == "h100-sxm" and d["nodes"] == 1 and d["fits"] is True
    assert d["peak_bytes"] == est.peak
    u = est.utilization
    assert u.tokens_per_s_per_device == pytest.approx(16 * 128 / 8 / est.step_time_s)
    assert 0 < est.mfu < est.hfu < 1  # checkpointing recomputes: the device does more than the model needs
    parts = est.step_time
    assert parts.seconds == pytest.approx(parts.compute + parts.comm + parts.overhead + parts.bubble)
    assert "tokens/s per device" in est.table()


def test_faster_hardware_is_faster(on_h100):
    a100 = estimate(fsdp_plan(), build, batch(), world_size=8, device="cuda", hardware="a100", dedup=False)
    assert a100.step_time_s > on_h100.step_time_s
    assert a100.peak == on_h100.peak  # the same simulated step


def test_a_slower_network_costs_across_nodes():
    slow = get("h100-sxm").with_network(1e9, "test: 8 Gb/s")
    one = estimate(fsdp_plan(), build, batch(), world_size=16, device="cuda", hardware=slow, nodes=1, dedup=False)
    two = estimate(fsdp_plan(), build, batch(), world_size=16, device="cuda", hardware=slow, nodes=2, dedup=False)
    assert two.step_time.comm > one.step_time.comm and two.step_time_s > one.step_time_s
    assert two.nodes == 2


def test_compile_fuses_memory_bound_kernels_and_keeps_flops(on_h100):
    compiled = estimate(
        fsdp_plan() | ca.compile(), build, batch(), world_size=8, device="cuda", hardware="h100-sxm", dedup=False
    )
    assert compiled.step_time.compute < on_h100.step_time.compute
    assert compiled.utilization.hardware_flops_per_device == pytest.approx(
        on_h100.utilization.hardware_flops_per_device
    )
    assert any("fusion rule" in n for n in compiled.notes)


def test_bad_hardware_and_nodes_refused_before_any_work(monkeypatch):
    import composable_atorch.estimate.core as core

    monkeypatch.setattr(core, "simulate_rank", lambda *a, **k: pytest.fail("simulated before refusing"))
    with pytest.raises(HardwareError, match="did you mean"):
        estimate(fsdp_plan(), build, batch(), world_size=8, device="cuda", hardware="h100-sx")
    with pytest.raises(ConfigError, match="nodes"):
        estimate(fsdp_plan(), build, batch(), world_size=8, device="cuda", hardware="h100-sxm", nodes=3)
    with pytest.raises(ConfigError, match="step_time"):
        estimate(fsdp_plan(), build, batch(), world_size=8, device="cuda", step_time="roofline")


def test_runtime_estimator_only_where_asked():
    est = estimate(fsdp_plan(), build, batch(), world_size=2, device="cuda", step_time="runtime-estimator", dedup=False)
    assert est.step_time_s is None and "CUDA" in est.extra["step_time_reason"]  # no GPU here


def test_cli_json_has_the_names_scripts_read(tmp_path, capsys):
    from composable_atorch.cli.estimate import main

    plan = tmp_path / "plan.json"
    plan.write_text(ca.compose(ca.fsdp(wrap=LlamaDecoderLayer), ca.amp("bf16")).to_json())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LlamaConfig(**CONFIG).to_dict(), "architectures": ["LlamaForCausalLM"]}))
    argv = [str(plan), "--model", f"hf:{config}", "--batch", "2", "--seq", "64", "--world-size", "16", "--nodes", "2"]
    assert main([*argv, "--gpu", "h100-sxm", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{") :])
    assert all(data[k] is not None for k in KEYS) and data["nodes"] == 2 and data["hardware"] == "h100-sxm"
    assert main([*argv, "--gpu", "h100-sxm", "--device-memory", "1MiB", "--json"]) == 1  # does not fit


# -- the GPU calibration's code path, without a GPU ---------------------------------------------------------
def fake_gpu_calibration(world=8) -> Calibration:
    """A calibration as measure() would write it on an H100 box, with made-up (round) timings."""
    curves = {
        f"mm_{d}": [[2.0 * n**3, 2.0 * n**3 / (500e12 if d != "float32" else 50e12)] for n in gpu.GEMM_SIZES]
        for d in gpu.DTYPES
    }
    b, h, d = gpu.ATTENTION_SHAPE
    for dt in ("float32", "bfloat16"):
        curves[f"sdpa_{dt}"] = [[4.0 * b * h * s * s * d, 4.0 * b * h * s * s * d / 300e12] for s in gpu.SEQS]
        curves[f"sdpa_bwd_{dt}"] = [[10.0 * b * h * s * s * d, 10.0 * b * h * s * s * d / 250e12] for s in gpu.SEQS]
    curves["memory"] = [[2.0 * n, 2.0 * n / 3.0e12] for n in gpu.MEMORY_SIZES]
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        curves[kind] = [[float(n), n / 200e9] for n in gpu.COMM_SIZES]
    return Calibration.from_dict(
        {
            "version": 1,
            "per_op_s": 0.0,
            "world": world,
            "curves": curves,
            "machine": {"gpu": "NVIDIA H100 80GB HBM3", "attention_shape": list(gpu.ATTENTION_SHAPE)},
        }
    )


def test_a_gpu_calibration_round_trips_and_replaces_the_paper_curves(tmp_path):
    path = tmp_path / "calibration-gpu.json"
    save(fake_gpu_calibration(), path)
    hw = gpu.as_hardware(load(path))
    assert hw.name == "h100-sxm (calibrated)"
    assert hw.gemm["bfloat16"](2.0 * 4096**3) == pytest.approx(500e12 / 989.4e12)
    assert hw.attention["flash_fwd"](2048) == pytest.approx(300e12 / 989.4e12)
    assert hw.attention["flash_bwd"](2048) == pytest.approx(250e12 / 989.4e12)
    assert hw.memory(2.0**25) == pytest.approx(3.0e12 / 3.35e12)
    ar = hw.intra.collectives["all_reduce"](1e8)
    assert ar == pytest.approx(2 * 7 / 8 * 200e9 / 450e9)
    assert hw.gemm["float8"] == get("h100-sxm").gemm["float8"]  # not measured: the paper figure stays


def test_one_gpu_keeps_the_paper_collectives():
    hw = gpu.as_hardware(fake_gpu_calibration(world=1))
    assert hw.intra.collectives == get("h100-sxm").intra.collectives


def test_gpu_calibration_errors():
    bad = fake_gpu_calibration()
    with pytest.raises(HardwareError):
        gpu.as_hardware(Calibration(bad.curves, 0.0, 8, {"gpu": "Some Future GPU"}))
    with pytest.raises(CalibrationError):
        Calibration.from_dict({"version": 1, "curves": {"mm_float32": [[1, -1]]}, "per_op_s": 0})
    with pytest.raises(ConfigError):
        calibration(device="tpu")
    if not torch.cuda.is_available():
        from composable_atorch.estimate.inputs import EstimateError

        with pytest.raises(EstimateError, match="GPU"):
            calibration(device="cuda")


@pytest.mark.parametrize("dedup", [False, True])
def test_an_fp8_plan_without_amp_is_measured_against_the_bf16_peak(dedup):
    """An fp32 model whose Linears run in float8 (torchao emulates them in fp32 on this CPU): MFU counts
    the GEMMs at the dtype the GPU runs them in, so against the bf16 peak as every fp8 plan, not
    the fp32 peak its attention runs at (that gave an MFU of 100% and an HFU over 1)."""
    pytest.importorskip("torchao")
    plan = ca.fsdp(wrap=LlamaDecoderLayer) | ca.fp8(recipe="tensorwise") | ca.checkpoint(LlamaDecoderLayer)
    shape = torch.Size([16, 256])
    big = dict(CONFIG, hidden_size=256, intermediate_size=512, max_position_embeddings=512, num_hidden_layers=6)
    est = estimate(
        plan,
        lambda: AutoModelForCausalLM.from_config(LlamaConfig(**big)),
        {"input_ids": shape, "labels": shape},
        world_size=8,
        device="cuda",
        hardware="h100-sxm",
        dedup=dedup,  # with it: identical blocks simulated a few times, the priced step extrapolated
    )
    assert dedup == any("extrapolated per block" in n for n in est.notes), est.notes
    u = est.utilization
    assert u.peak_dtype == "bfloat16" and u.peak_flops == get("h100-sxm").peak("bfloat16")
    assert 0 < est.mfu < est.hfu < 1

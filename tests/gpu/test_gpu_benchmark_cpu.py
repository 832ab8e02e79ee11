"""The parts of benchmarks/gpu.py that need no GPU: arguments, the analytic model size and FLOPs, MFU, the
plans it measures, its junit reading and its table; and that on a machine without CUDA it exits 0, says
so and writes nothing (issue 31)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("gpu_benchmark", Path(__file__).parents[2] / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu  # its dataclasses look their module up
_spec.loader.exec_module(gpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_checks_arguments_says_so_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--out", str(out), "--size", "tiny"]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    assert not out.exists()
    with pytest.raises(SystemExit):
        gpu.main(["--parts", "tests,nonsense"])


@pytest.mark.parametrize(
    "argv", [["--batch", "0"], ["--batch", "many"], ["--seq", "0"], ["--parts", ""], ["--search-s", "-1"]]
)
def test_bad_arguments_are_refused_before_any_work(argv):
    with pytest.raises(SystemExit):
        gpu.parse_args(argv)


def test_good_arguments_parse():
    args = gpu.parse_args(["--batch", "4", "--parts", "tests, throughput"])
    assert args.batch == 4 and args.parts == ("tests", "throughput")
    assert gpu.parse_args([]).batch == "auto"


def test_published_peaks_pick_the_right_h100_variant():
    assert gpu.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert gpu.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert gpu.peak_bf16_flops("Some Future Card") is None


def test_analytic_parameter_count_matches_the_transformers_model():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    shape = gpu.SIZES["tiny"]
    model = AutoModelForCausalLM.from_config(shape.config())
    assert shape.params() == sum(p.numel() for p in model.parameters())
    # TinyLlama's published size: 1,100,048,384 parameters
    assert gpu.SIZES["1b"].params() == 1_100_048_384


def test_mfu_is_model_flops_over_the_peak():
    shape = gpu.SIZES["1b"]
    per_token = 6 * (shape.params() - shape.vocab * shape.hidden) + 12 * shape.layers * shape.hidden * 2048
    assert shape.flops_per_token(2048) == per_token
    assert gpu.mfu(10_000, shape, 2048, 1e15) == pytest.approx(10_000 * per_token / 1e15)
    assert gpu.mfu(10_000, shape, 2048, None) is None


def test_fp8_plan_is_measured_only_with_torchao_on_sm89_plus():
    block = torch.nn.Linear
    plans = gpu.library_plans(block, (9, 0), have_torchao=False)
    assert "torchao is not installed" in plans["amp|checkpoint|fp8"]
    assert "sm89+" in gpu.library_plans(block, (8, 0), have_torchao=True)["amp|checkpoint|fp8"]
    plans = gpu.library_plans(block, (9, 0), have_torchao=True)
    assert not isinstance(plans["amp|checkpoint|fp8"], str)
    assert set(plans["amp|checkpoint|compile"].names) == {"amp", "checkpoint", "compile"}


def test_tokens_and_the_hf_loss_train_a_tiny_llama():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    shape = gpu.SIZES["tiny"]
    data = gpu.Tokens(shape.vocab, 16, n=4)
    assert torch.equal(data[1], gpu.Tokens(shape.vocab, 16, n=4)[1]) and not torch.equal(data[0], data[1])
    model = AutoModelForCausalLM.from_config(shape.config())
    loss = gpu.hf_loss(model, torch.stack([data[0], data[1]]))
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_junit_counts_and_table():
    xml = (
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
        '<testcase classname="t" name="c"><skipped/></testcase><testcase classname="t" name="d"/>'
        "</testsuite></testsuites>"
    )
    n = gpu.junit_counts(xml)
    assert (n["passed"], n["failures"], n["skipped"], n["failed_names"]) == (2, 1, 1, ["t.b"])
    result = {
        "env": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cuda": "13.0"},
        "tests": n,
        "throughput": {
            "rows": {
                "amp": {"tokens_per_s": 50_000.0, "mfu": 0.41, "vs_accelerate_bf16": 1.03},
                "amp|checkpoint|fp8": {"skipped": "skipped: torchao is not installed"},
            }
        },
        "estimate": {"amp": {"measured_peak": 1, "peak_error": 0.05, "step_s_error": None}},
        "search": {"pick": "amp", "ab": {"vs_accelerate_bf16": 1.1}},
    }
    text = gpu.table(result)
    assert "2 passed, 1 failed, 1 skipped" in text
    assert "41.0%" in text and "1.03x" in text and "torchao is not installed" in text
    assert "peak +5%  step: paper -, calibrated -" in text and "1.10x Accelerate bf16" in text

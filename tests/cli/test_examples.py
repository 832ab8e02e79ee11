"""Every example's tiny mode at world 2 through the project's launcher: a broken example fails CI.

Each runs as a user would (``python -m composable_atorch launch --nproc 2 examples/X.py``) and is
checked on what it promises: the resume message, the files it saves, the plan it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.dist


def launch(script: str, *args: str, env: dict | None = None, timeout: float = 240, cwd: Path | None = None) -> str:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("OMP_NUM_THREADS", None)  # the launcher sets 1 per rank
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nproc", "2", str(EXAMPLES / script), *args]
    proc = subprocess.run(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def test_compose_gpt_trains_saves_and_resumes(tmp_path):
    launch("compose_gpt.py", "--out", str(tmp_path), "--stop-at", "4")
    out = launch("compose_gpt.py", "--out", str(tmp_path))
    assert "resumed from step-00000004 at step 4; skipping the 4 batch(es) of epoch 0 already seen" in out
    assert "trained to step 8" in out
    assert (tmp_path / "final" / "model.safetensors").is_file()
    records = [json.loads(line) for line in (tmp_path / "compose_gpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "metrics"] == list(range(1, 9))


@pytest.mark.parametrize("switch", ["", "USE_LORA", "USE_FP8"])
def test_fsdp_llama2(tmp_path, switch):
    env = {switch: "1"} if switch else {}
    out = launch("fsdp_llama2.py", "--out", str(tmp_path), "--steps", "2" if switch == "USE_FP8" else "4", env=env)
    assert "fsdp(wrap LlamaDecoderLayer" in out and "amp(bf16)" in out and "checkpoint(LlamaDecoderLayer" in out
    files = {p.name for p in (tmp_path / "final").iterdir()}
    if switch == "USE_LORA":
        assert "trainable parameters in the root group" in out and "(LoRA adapter)" in out
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    else:
        assert {"config.json", "model.safetensors"} <= files
    if switch == "USE_FP8":
        assert "fp8: q_proj is Float8Linear, lm_head is Linear (excluded)" in out


def test_auto_llama2_searches_prints_trials_and_trains(tmp_path):
    out = launch("auto_llama2.py", "--out", str(tmp_path), "--trials", "2", timeout=400)
    assert "samples/s" in out  # the trials table
    assert (tmp_path / "best_plan.json").is_file() and "last loss" in out


def test_accelerate_to_composable_both_scripts_and_resume(tmp_path):
    out = launch("accelerate_to_composable.py", "--out", str(tmp_path))
    assert "[ddp] step 6" in out and "[composable] step 6" in out
    assert (tmp_path / "model" / "model.safetensors").is_file()
    out = launch(
        "accelerate_to_composable.py", "--out", str(tmp_path), "--mode", "composable", "--resume", "--steps", "8"
    )
    assert "resumed from step-00000006 at step 6; skipping the 12 batch(es)" in out and "[composable] step 8" in out


def test_atorch_nanogpt_fsdp_script_unchanged_but_imports(tmp_path):
    """ATorch's nanoGPT FSDP script (import prefix and device changed only), tiny, at world 2: it calls
    FSDP1's ``model.clip_grad_norm_`` on the FSDP2 model and logs the norm with TensorBoard."""
    import numpy as np

    pytest.importorskip("tensorboard")
    rng = np.random.default_rng(0)
    tokens = np.tile(rng.integers(0, 50, size=97), 200).astype(np.uint16)  # a repeating cycle: learnable
    tokens[:17460].tofile(tmp_path / "train.bin")
    tokens[17460:].tofile(tmp_path / "val.bin")
    out = launch(
        "atorch_nanogpt/train_atorch.py",
        *("--device=cpu", "--dtype=bfloat16", f"--dataset={tmp_path}/", f"--tb_path={tmp_path}"),
        *("--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4"),
        *("--max_iters=6", "--decay_lr=False", "--learning_rate=0.003", "--eval_interval=100"),
        cwd=EXAMPLES / "atorch_nanogpt",  # the script execs configurator.py from its working directory
        timeout=400,
    )
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("iter ")]
    assert len(losses) == 7 and losses[-1] < losses[0] - 0.5, losses
    assert "fsdp(wrap Block" in out and "amp(bf16)" in out
    events = list((tmp_path / "fsdp-bfloat16").glob("events.out.tfevents.*"))
    assert events and b"Grad norm" in events[0].read_bytes()


def test_atorch_auto_accelerate_gpt2_fsdp_example_unchanged_but_imports():
    """ATorch's auto_accelerate example (train_gpt2_entry.sh's arguments, smaller data), imports changed only.
    The script prints no loss (only sec/step), so it is checked on running its steps to the end."""
    out = launch(
        "atorch_auto_accelerate/train.py",
        *("--model_type", "gpt2", "--distributed", "--hidden_size", "64", "--head_num", "4", "--layer_num", "4"),
        *("--seq_length", "32", "--load_strategy", "--use_fsdp", "--datasize", "32", "--epoch", "1"),
        *("--log_interval", "1"),
        cwd=EXAMPLES / "atorch_auto_accelerate",  # the script imports its data.py / modeling.py
    )
    assert "[step=3]" in out and out.count("Finished training!") == 2

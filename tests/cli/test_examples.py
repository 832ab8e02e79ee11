"""Every example of the project's own in its tiny mode at world 2 through the project's launcher: a
broken example fails CI (ATorch's ported examples: ``test_atorch_examples.py``).

Each runs as a user would (``python -m composable_atorch launch --nproc 2 examples/X.py``) and is
checked on what it promises: the resume message, the files it saves, the plan it prints.
"""

from __future__ import annotations

import json

import pytest
from examples_launch import launch

pytestmark = pytest.mark.dist


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

"""ATorch's examples (dlrover's ``atorch/examples``), ported in the import prefix only, run tiny at world 2
(the ds_3d one at world 4) through the project's launcher, and checked on a loss that falls, parsed from
what they print."""

from __future__ import annotations

import math

import pytest
from examples_launch import EXAMPLES, launch, losses_of

pytestmark = pytest.mark.dist


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


# ATorch's auto_accelerate train.py prints sec/step only; this driver runs it unchanged (runpy, as
# __main__) with the facade's returned loss_func wrapped to print each step's loss on rank 0.
LOSS_PROBE = """
import os, runpy, sys

import composable_atorch.compat.atorch as atorch
import composable_atorch.compat.atorch.auto as auto
import composable_atorch.compat.atorch.auto.accelerate as accelerate

real = accelerate.auto_accelerate


def probed(*args, **kwargs):
    status, res, best = real(*args, **kwargs)
    inner = res.loss_func

    def loss_func(*a, **k):
        loss = inner(*a, **k)
        if os.environ.get("RANK", "0") == "0":
            print(f"probe loss {float(loss):.6f}", flush=True)
        return loss

    return status, res._replace(loss_func=loss_func), best


accelerate.auto_accelerate = auto.auto_accelerate = atorch.auto_accelerate = probed
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize(
    "model",
    [
        ("toy", "--datasize", "96", "--epoch", "2", "--batchsize", "4"),
        ("gpt2", "--hidden_size", "64", "--head_num", "4", "--layer_num", "4", "--seq_length", "32"),
    ],
    ids=["toy", "gpt2"],
)
def test_atorch_auto_accelerate_fsdp_example_unchanged_but_imports(tmp_path, model):
    """ATorch's auto_accelerate example, imports changed only, with ``--load_strategy --use_fsdp`` at world 2
    (the toy model, and train_gpt2_entry.sh's GPT-2 with less data). Its losses are read through the probe.

    The toy's MSE falls. ATorch's GPT-2 data are fresh uniformly random tokens on every read (its
    BenchmarkLMDataset), so nothing can be learned and the loss cannot fall: it is checked to stay at
    the uniform loss ln(50257) = 10.82, finite at every step."""
    (tmp_path / "probe.py").write_text(LOSS_PROBE)
    name, *extra = model
    out = launch(
        str(tmp_path / "probe.py"),
        str(EXAMPLES / "atorch_auto_accelerate" / "train.py"),
        *("--model_type", name, "--distributed", "--load_strategy", "--use_fsdp", "--log_interval", "1", *extra),
        *(("--datasize", "32", "--epoch", "1") if name == "gpt2" else ()),
        cwd=EXAMPLES / "atorch_auto_accelerate",  # the script imports its data.py / modeling.py
    )
    assert out.count("Finished training!") == 2
    losses = losses_of(out, r"^probe loss ([-\d.e]+)$")
    if name == "toy":
        assert len(losses) == 96 // 4 * 2, losses  # two epochs of 96 rows, a global batch of 4 per step
        assert sum(losses[-8:]) < 0.25 * sum(losses[:8]), losses  # unseeded shuffling: ~30 -> ~1.5 seen
    else:
        assert "[step=3]" in out and len(losses) == 4, losses
        assert all(abs(v - math.log(50257)) < 0.5 for v in losses), losses


def test_atorch_ds_3d_llama2_unchanged_but_imports_at_world_4(tmp_path):
    """ATorch's ds_3d_llama2.py, imports changed only, with ds_3d_llama2_entry.sh's layout (tensor 2 x
    pipeline 2) at world 4: ATorch's TPInfo written for transformers 4, ``module_replace`` with
    ``deepspeed_3d_parallel``, its batch_fn, loss mask and vocabulary-parallel cross entropy. The tiny
    Llama, tokenizer and text come from make_tiny_llama.py (nothing downloaded).

    The reference is the same script at pipeline 2 alone (world 2: no tensor sharding, the same data
    and global batch, each layer seeded alike): the losses must agree step by step, and fall."""
    pytest.importorskip("deepspeed")
    import runpy

    runpy.run_path(str(EXAMPLES / "atorch_llama2" / "make_tiny_llama.py"))["main"]([str(tmp_path)])
    steps = 8
    runs = {}
    for tensor, world in ((1, 2), (2, 4)):
        out = launch(
            "atorch_llama2/ds_3d_llama2.py",
            *("--pipeline_parallel_size", "2", "--model_parallel_size", str(tensor), "--block_size", "32"),
            *("--max_steps", str(steps), "--ds_config", str(tmp_path / "ds_config.json")),
            *("--model_name_or_path", str(tmp_path / "model"), "--dataset_path", str(tmp_path / "wikitext")),
            cwd=EXAMPLES / "atorch_llama2",
            nproc=world,
            timeout=500,
        )
        assert f"3D parallel: tensor {tensor}, data 1, pipeline 2" in out and "Global batch size: 8" in out
        runs[tensor] = losses_of(out, r" iter: \d+, loss: ([-\d.e]+),")  # "<time> iter: i, loss: x, elapsed ..."
        assert len(runs[tensor]) == steps, out[-3000:]
    losses = runs[2]
    assert all(abs(a - b) < 2e-3 for a, b in zip(runs[1], losses)), runs  # seen: equal to 4 decimals
    assert abs(losses[0] - math.log(512)) < 0.2 and losses[-1] < losses[0] - 0.4, losses  # seen: 6.25 -> 5.51


def test_atorch_fsdp_llama2_unchanged_but_imports(tmp_path):
    """ATorch's fsdp_llama2.py, imports (and the CUDA device) changed only, with fsdp_llama2_entry.sh's
    options (bf16 amp, gradient checkpointing; module_replace and FSDP1's options in its strategy) at world 2.

    The script hard-codes ATorch's fine-tuning learning rate (AdamW 1e-5), at which a tiny Llama moves
    by a few thousandths per step: the text is cut to 4 blocks, so each rank sees the same batch every
    step and the loss must fall at every step (seen: 6.2895 -> 6.2519 in 12 steps, by 0.003 each)."""
    pytest.importorskip("peft")  # the script imports it
    import runpy

    runpy.run_path(str(EXAMPLES / "atorch_llama2" / "make_tiny_llama.py"))["main"]([str(tmp_path), "--blocks", "4"])
    steps = 12
    out = launch(
        "atorch_llama2/fsdp_llama2.py",
        *("--block_size", "32", "--max_steps", str(steps), "--per_device_train_batch_size", "2"),
        *("--precision", "bf16_amp", "--gradient_checkpointing"),
        *("--model_name_or_path", str(tmp_path / "model"), "--dataset_path", str(tmp_path / "wikitext")),
        cwd=EXAMPLES / "atorch_llama2",
    )
    assert "fsdp(wrap LlamaDecoderLayer" in out and "amp(bf16)" in out and "Global batch size: 4" in out
    losses = losses_of(out, r" iter: \d+, loss: ([-\d.e]+),")
    assert len(losses) == steps, out[-3000:]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.02, losses

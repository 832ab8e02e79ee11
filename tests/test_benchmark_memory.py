"""Smoke test of benchmarks/memory.py's measurement functions (the benchmark itself is not run here)."""

import importlib.util
from pathlib import Path

import torch

import composable_atorch as ca
from composable_atorch.models import GPT, Block, GPTConfig

_spec = importlib.util.spec_from_file_location("memory_benchmark", Path(__file__).parent.parent / "benchmarks" / "memory.py")
memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory)


def test_state_bytes_counts_params_grads_and_adam_state_exactly():
    model = torch.nn.Linear(4, 3)  # 15 float32 values
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    # Adam keeps exp_avg and exp_avg_sq per parameter (2 x 60 bytes) and a float32 step per tensor (2 x 4)
    assert memory.state_bytes(model, optim) == {"params": 60, "grads": 60, "optimizer": 128, "total": 248}


def test_checkpointing_reduces_measured_activation_bytes():
    tokens = torch.randint(0, 256, (2, 32))
    sizes = {}
    for name, plan in (("none", ca.compose()), ("checkpoint", ca.checkpoint(Block))):
        torch.manual_seed(0)
        model, _, _ = plan(GPT(GPTConfig(seq_len=32, d_model=32, n_layer=4, n_head=2)))
        sizes[name] = memory.activation_bytes(model, tokens)
    for how in ("saved", "profiler"):
        assert 0 < sizes["checkpoint"][how] < sizes["none"][how] / 2, (how, sizes)

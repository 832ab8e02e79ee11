"""A probe of a model's structure without its weights: a guessed example input
(:mod:`composable_atorch.transforms.example_input`: ids, images, or both) and a zero-weight CPU
replica to run it on. The tensor-parallel planner traces and verifies its plans on it; ddp finds
the parameters that get no gradient (an MLM head's unused bias, a vision model's spare classifier
branch) before torch's reducer fails on them at the second step.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn

from composable_atorch.transforms.example_input import (  # noqa: F401 - re-exported
    example_input,
    features,
    is_conv1d,
    is_linear,
)


def replica(model: nn.Module, grad: bool = False) -> nn.Module:
    """A CPU copy of ``model`` with zero weights (nothing copied from the real ones; parameters
    require grad only with ``grad``). Only shapes are read, so a model without real weights gets a
    replica of fake tensors: one of fake tensors (``estimate`` applies the plan on them) in the same
    fake mode, one on the meta device (a search on paper builds the model there) in a fake mode of its
    own. A real copy would allocate the whole model's weights (a 7B model: 27 GB) for a plan that is
    only being planned. :func:`run` and :func:`probe_unused` run a replica in its fake mode."""
    memo = {}
    with _fake_mode_of(model):
        for t in (*model.parameters(), *model.buffers()):
            if id(t) in memo:
                continue
            z = torch.zeros(t.shape, dtype=t.dtype, device="cpu")
            if isinstance(t, nn.Parameter):
                memo[id(t)] = nn.Parameter(z, requires_grad=grad and t.requires_grad)
            else:
                memo[id(t)] = z
    return copy.deepcopy(model, memo)


def _fake_of(model: nn.Module):
    """The fake mode of the model's fake tensors, or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake = next((t for t in (*model.parameters(), *model.buffers()) if isinstance(t, FakeTensor)), None)
    return None if fake is None else fake.fake_mode


def _fake_mode_of(model: nn.Module):
    """The fake mode of the model's fake parameters; a new one (real inputs allowed: the example input
    is real) for a model on the meta device; a null context for a real model."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = _fake_of(model)
    if mode is not None:
        return mode
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return FakeTensorMode(allow_non_fake_inputs=True)
    return contextlib.nullcontext()


def _running(rep: nn.Module):
    """The mode a replica runs in: its fake tensors' mode (unless that one is already active), else none."""
    import contextlib

    from torch._guards import active_fake_mode

    mode = _fake_of(rep)
    return contextlib.nullcontext() if mode is None or active_fake_mode() is mode else mode


def run(model: nn.Module, example) -> None:
    """One no-grad forward; the CPU random stream is restored after it (a probe's dropouts must not
    shift the masks training draws)."""
    args, kwargs = example
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _running(model):
        model(*args, **kwargs)


class Probe(NamedTuple):
    """What a probe step found: the trainable parameters without a gradient, or, when the model could
    not be probed, None and the reason (for explain)."""

    unused: list[str] | None
    reason: str = ""


def probe_unused(model: nn.Module) -> Probe:
    """One forward/backward of the zero-weight replica on the example input (the sum of its floating
    outputs as the loss): the trainable parameters that get no gradient."""
    example = example_input(model)
    if example is None:
        return Probe(
            None,
            "no example input could be built for it (no config's main input, no first Embedding / Conv2d / Linear)",
        )
    try:
        rep = replica(model, grad=True)
    except Exception as e:  # noqa: BLE001 - a model deepcopy cannot copy is not probed
        return Probe(None, f"it could not be copied for the probe ({type(e).__name__}: {str(e)[:160]})")
    args, kwargs = example
    shown = ", ".join(f"{k}{list(v.shape)}" for k, v in kwargs.items()) or ", ".join(str(list(a.shape)) for a in args)
    try:
        with torch.random.fork_rng(devices=[]), _running(rep):
            out = rep(*args, **kwargs)
            leaves = out.values() if isinstance(out, dict) else (out if isinstance(out, tuple | list) else (out,))
            floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
            if not floats:
                return Probe(None, f"its forward on the example input ({shown}) returned no floating tensor")
            sum(t.float().sum() for t in floats).backward()
    except Exception as e:  # noqa: BLE001 - a model that does not take the guessed input is not probed
        return Probe(None, f"its forward on the example input ({shown}) failed: {type(e).__name__}: {str(e)[:160]}")
    return Probe([n for n, p in rep.named_parameters() if p.requires_grad and p.grad is None])


def unused_parameters(model: nn.Module) -> list[str] | None:
    """:func:`probe_unused`'s names; None when the model could not be probed."""
    return probe_unused(model).unused

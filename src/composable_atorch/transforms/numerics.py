"""Comparing a distributed model's forward with the whole model's: what the numerical guards share.

A plan can fit every shape and still compute another function (a fused projection read with a
head count fixed at init under tensor parallelism; an attention feature a sequence split does not
carry over). The guards (tensor/check.py, sequence/check.py) run one probe forward of the whole
model and of the distributed one before any step; this module holds their common parts: the
forward's mode (eval, no graph, RNG untouched), its output tensor and the tolerance.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

#: relative tolerance (of the largest output) for fp32; reduced precision widens it by its epsilon
RTOL = 1e-4


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Dropout off, no graph, the random streams untouched; each module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def output_tensor(out) -> torch.Tensor | None:
    """The tensor a forward returns (logits, a loss, a plain tensor), whole and in fp32."""
    if hasattr(out, "logits"):
        out = out.logits
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    if isinstance(out, tuple | list):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return out.detach().float()


def tolerance(model: nn.Module) -> float:
    """Of the output's scale: ``RTOL`` in fp32; a few epsilons of a half dtype the model was cast to
    (sharded sums round in another order); TF32 matmuls on a GPU round to ~1e-3."""
    p = next(iter(model.parameters()))
    rtol = max(RTOL, 8 * torch.finfo(p.dtype).eps) if p.dtype.is_floating_point else RTOL
    if p.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        rtol = max(rtol, 1e-2)
    return rtol

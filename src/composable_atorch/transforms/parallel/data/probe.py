"""A probe of a model's structure without its weights: a guessed example input and a zero-weight
CPU replica to run it on. The tensor-parallel planner traces and verifies its plans on it; ddp
finds the parameters that get no gradient (an MLM head's unused bias) before torch's reducer
fails on them at the second step.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def is_conv1d(m) -> bool:
    return (
        type(m).__name__ == "Conv1D"
        and hasattr(m, "nf")
        and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2
    )


def is_linear(m) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def features(m) -> tuple[int, int]:
    """``(in, out)`` of a Linear or Conv1D."""
    return (m.weight.shape[0], m.weight.shape[1]) if is_conv1d(m) else (m.in_features, m.out_features)


def example_input(model: nn.Module) -> tuple[tuple, dict] | None:
    """A few tokens the model accepts: HF models by their main input name, plain models by their first
    layer (an Embedding takes ids, a Linear takes features). None when no guess is possible."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(model, "main_input_name"):
        vocab = int(getattr(cfg, "vocab_size", 2) or 2)
        ids = torch.arange(8).remainder(max(vocab - 1, 1)).add(1).unsqueeze(0)
        kwargs = {model.main_input_name: ids}
        if getattr(cfg, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        return (), kwargs
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return (torch.arange(8).remainder(m.num_embeddings).unsqueeze(0),), {}
        if is_linear(m):
            return (torch.zeros(1, 8, features(m)[0], dtype=m.weight.dtype),), {}
    return None


def replica(model: nn.Module, grad: bool = False) -> nn.Module:
    """A CPU copy of ``model`` with zero weights (nothing copied from the real ones; parameters
    require grad only with ``grad``)."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        z = torch.zeros(t.shape, dtype=t.dtype, device="cpu")
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(z, requires_grad=grad and t.requires_grad)
        else:
            memo[id(t)] = z
    return copy.deepcopy(model, memo)


def run(model: nn.Module, example) -> None:
    """One no-grad forward; the CPU random stream is restored after it (a probe's dropouts must not
    shift the masks training draws)."""
    args, kwargs = example
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        model(*args, **kwargs)


def unused_parameters(model: nn.Module) -> list[str] | None:
    """Names of trainable parameters that get no gradient from one forward/backward of the replica
    on an example input (the sum of its floating outputs as the loss); None when it cannot run."""
    example = example_input(model)
    if example is None:
        return None
    rep = replica(model, grad=True)
    args, kwargs = example
    try:
        with torch.random.fork_rng(devices=[]):
            out = rep(*args, **kwargs)
        leaves = out.values() if isinstance(out, dict) else (out if isinstance(out, tuple | list) else (out,))
        floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        if not floats:
            return None
        sum(t.float().sum() for t in floats).backward()
    except Exception:  # noqa: BLE001 - a model that does not take the guessed input is not probed
        return None
    return [n for n, p in rep.named_parameters() if p.requires_grad and p.grad is None]

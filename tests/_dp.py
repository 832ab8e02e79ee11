"""Helpers for the data-parallel tests: the shared tiny GPT and loop (helpers.py) at their sizes.

Every run starts from the same seed and sees the same global batches, so a world-2 run can be
compared with one process (``reference``) and sharded runs with ddp.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

import composable_atorch as ca

from helpers import text_loader, tiny_gpt
from helpers import train as shared_train

SEQ, BATCH, STEPS = 16, 8, 5


def model() -> torch.nn.Module:
    return tiny_gpt(0, seq_len=SEQ, d_model=16)


def loader(batch: int = BATCH, shuffle: bool = False) -> DataLoader:
    return text_loader(SEQ, batch=batch, limit=64, shuffle=shuffle)


def full_params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by the user's names, gathered whole (DTensor shards -> full tensors)."""
    out = {}
    for name, p in ca.runtime.optim.named_parameters(m).items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def train(m, optim, data, steps: int = STEPS, *, on_grads=None) -> list[float]:
    """The one loop every plan trains with (helpers.train); ``steps`` optimizer steps."""
    return shared_train(m, optim, data, steps, on_grads=on_grads, wrap=False)


def reference(steps: int = STEPS, lr: float = 1e-3, clip: float | None = None):
    """One process, no plan, the same global batches: what data parallelism must reproduce."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    clip_fn = None if clip is None else (lambda mod: torch.nn.utils.clip_grad_norm_(mod.parameters(), clip))
    losses = shared_train(m, opt, loader(), steps, on_grads=clip_fn, wrap=False)
    return full_params(m), losses


def run_plan(*transforms, steps: int = STEPS, lr: float = 1e-3, batch: int = BATCH):
    """Apply ``compose(*transforms)`` to a fresh model/AdamW/loader and train; return what tests compare."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    plan = ca.compose(*transforms)
    applied = plan(m, opt, loader(batch))
    m, opt, data = applied
    losses = train(m, opt, data, steps)
    explain = plan.explain(applied=applied)
    return {
        "params": full_params(m),
        "losses": losses,
        "finite": all(map(math.isfinite, losses)),
        "explain": explain,
        "plan": plan,
        "model": m,
        "optim": opt,
        "loader": data,
    }


def plain(value):
    """Tensors -> numpy arrays, recursively: results cross the process boundary by value
    (torch's shared-memory tensor passing breaks when the sending rank has already exited)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((torch.as_tensor(a[k]).float() - torch.as_tensor(b[k]).float()).abs().max()) for k in a)


def bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)

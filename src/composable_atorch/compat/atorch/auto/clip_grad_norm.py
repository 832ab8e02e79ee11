"""``atorch.auto.clip_grad_norm``: clip a model the facade returned, whatever its parallelism.

The gradients of sharded (FSDP2) and tensor-parallel parameters are DTensors, over which torch's
``clip_grad_norm_`` computes the global norm itself; the full norm comes back as a plain tensor.
"""

from __future__ import annotations

import torch


def clip_grad_norm(model, max_norm, norm_type=2):
    """Clip every gradient of ``model`` to a global ``max_norm``; returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


__all__ = ["clip_grad_norm"]

"""``atorch.auto.clip_grad_norm``: clip a model the facade returned, whatever its parallelism.

The gradients of sharded (FSDP2) and tensor-parallel parameters are DTensors, over which torch's
``clip_grad_norm_`` computes the global norm itself; the full norm comes back as a plain tensor.
"""

from __future__ import annotations

from composable_atorch.transforms.parallel.data.common import full_clip_grad_norm_


def clip_grad_norm(model, max_norm, norm_type=2):
    """Clip every gradient of ``model`` to a global ``max_norm``; returns the norm before clipping."""
    return full_clip_grad_norm_(model.parameters(), max_norm, norm_type)


__all__ = ["clip_grad_norm"]

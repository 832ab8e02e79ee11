"""Transformers 5 mixtures of experts on fake tensors.

Their experts run ``torch.nn.functional.grouped_mm`` where torch has it; on the CPU its kernel takes
fp32, but torch's fake (meta) registration of ``grouped_mm`` accepts bf16 only, so an fp32 MoE model
cannot be simulated as it runs. Transformers' own fallback (``transformers::grouped_mm_fallback``,
registered with a fake implementation) computes the same products with the same output shapes, so
while a step is simulated the dispatcher is pointed at it for fake tensors. Real tensors are untouched.
"""

from __future__ import annotations

import contextlib

from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def fake_grouped_mm():
    """Within: transformers' grouped-mm check answers False for fake weights (the fallback runs)."""
    try:
        from transformers.integrations import moe
    except ImportError:  # no transformers (or no MoE support in it): nothing to route
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def can_use(input, weight, offs):
        if isinstance(weight, FakeTensor) or isinstance(input, FakeTensor):
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original

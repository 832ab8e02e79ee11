"""The plan's precision decision, in one place: a small policy value (like FSDP2's MixedPrecisionPolicy).

Several transforms need to know the dtypes a plan trains in: sharding all-gathers parameters in
them, module_replace filters kernels by them, DeepSpeed maps them onto its own bf16 / fp16 config.
So that "half wins over amp" is written once, they declare ``reads=PRECISION_READS`` in their
contract and call :meth:`PrecisionPolicy.of` instead of asking the plan for ``amp`` and ``half``.

Rules (written once, here):

* ``half(d)`` casts the parameters to ``d``: parameters and compute are in ``d``;
* else ``amp(d)`` autocasts the forward: parameters stay float32, compute is in ``d``;
* else everything is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composable_atorch.core.transform import ApplyContext
from composable_atorch.transforms._util import dtype_of

#: The transforms a precision-aware transform reads; put them in its contract's ``reads``.
PRECISION_READS = ("amp", "half")


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype``: what the parameters are stored in; ``compute_dtype``: what the forward runs in.

    ``source`` names the transform that decided (``"half"``, ``"amp"`` or ``None`` for float32);
    ``name`` is the short dtype name (``"bf16"``, ``"fp16"`` or ``None``).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    source: str | None = None
    name: str | None = None

    @property
    def autocast(self) -> bool:
        """True when parameters stay float32 and only the forward runs in a lower precision (amp)."""
        return self.source == "amp"

    @classmethod
    def of(cls, ctx: ApplyContext) -> PrecisionPolicy:
        """The plan's policy; the caller's contract must declare ``reads=PRECISION_READS``."""
        half = ctx.find("half")
        if half is not None:
            d = dtype_of(half.dtype)
            return cls(param_dtype=d, compute_dtype=d, source="half", name=half.dtype)
        amp = ctx.find("amp")
        # ATorch's amp_native {"enabled": False} keeps the plan in float32
        if amp is not None and getattr(amp, "enabled", True):
            return cls(param_dtype=torch.float32, compute_dtype=dtype_of(amp.dtype), source="amp", name=amp.dtype)
        return cls()

"""ATorch's nanoGPT example ships its own AGD optimizer here (model.py imports it for ``opt_name="agd"``).

The library does not build AGD: ``composable_atorch.compat.atorch.optimizers.AGD`` raises a
ConfigError naming what to use instead (the FSDP script trains with torch.optim.AdamW anyway).
"""

from composable_atorch.compat.atorch.optimizers import AGD

__all__ = ("AGD",)

"""ATorch's import paths over this library: a port of an ATorch script changes its import prefix only.

    import composable_atorch.compat.atorch as atorch                       # was: import atorch
    from composable_atorch.compat.atorch.auto import auto_accelerate        # was: from atorch.auto import ...
    from composable_atorch.compat.atorch.distributed.distributed import parallel_group_size

Each name is the library's counterpart (``auto_accelerate`` is the facade, ``record_module_init``
the library's), a small helper over the groups of the last plan the facade applied (see
:mod:`composable_atorch.compat.groups`), or, for an algorithm the library does not have (AGD,
local SGD), a typed error naming what to use instead.
"""

from composable_atorch.compat.accelerate import (
    AccelerateResult,
    AtorchStrategy,
    StrategyEntry,
    auto_accelerate,
    default_prepare_input,
)

# ATorch's scripts reach these as attributes of the package (``atorch.optimizers.AGD``)
from composable_atorch.compat.atorch import auto, distributed, optimizers  # noqa: E402 - after the names above
from composable_atorch.compat.atorch.distributed.distributed import (
    init_distributed,
    local_rank,
    rank,
    reset_distributed,
    world_size,
)

__version__ = "0.1.0"

__all__ = [
    "AccelerateResult",
    "AtorchStrategy",
    "StrategyEntry",
    "auto_accelerate",
    "auto",
    "default_prepare_input",
    "distributed",
    "init_distributed",
    "local_rank",
    "optimizers",
    "rank",
    "reset_distributed",
    "world_size",
]

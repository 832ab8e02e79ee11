"""The transform families, one module (or, under ``parallel/``, one sub-package) each.

Importing this package imports every family, so every built transform is in the registry.
"""

from composable_atorch.transforms import compile, fp8, loop, memory, modules, precision  # noqa: F401
from composable_atorch.transforms.parallel import data, ds3d, expert, mixed, pipeline, sequence, tensor  # noqa: F401

"""The transform families, one module (or, under ``parallel/``, one sub-package) each.

Importing this package imports every family, so every built transform is in the registry
(``parallel`` imports each of its axis packages itself).
"""

from composable_atorch.transforms import compile, fp8, loop, memory, modules, parallel, precision  # noqa: F401

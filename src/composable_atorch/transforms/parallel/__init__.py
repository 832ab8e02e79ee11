"""The parallel axes, one room each, as peers: ``data`` (parallel_mode, ddp, zero1, zero2, fsdp and
their DeepSpeed variants), ``tensor``, ``pipeline``, ``sequence`` (context parallelism, Ulysses),
``expert`` (MoE experts split, all-to-all dispatch); ``shared`` below them (the parallel context,
gradient averaging over a group, the model probe); ``mixed`` (tensor x pipeline x data, expanded
into those steps) and ``ds3d`` (DeepSpeed's pipeline engine) above them. The axes themselves are
declared in ``runtime/axes.py``; the layers contract in ``pyproject.toml`` keeps this order.

Importing this package imports every sub-package and module in it, so each registers its
transforms: a new axis's package is found here without a list to edit (see CONTRIBUTING.md).
"""

import importlib
import pkgutil

for _found in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_found.name}")

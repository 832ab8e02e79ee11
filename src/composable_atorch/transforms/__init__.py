"""One module per family of transforms. Importing this package registers every built transform."""

from . import compile, data_parallel, deepspeed, fp8, loop, memory, modules, precision, sharding  # noqa: F401

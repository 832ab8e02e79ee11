"""One module per family of transforms; ``parallel/`` holds the data- and model-parallel families.

Importing this package registers every built transform.
"""

from composable_atorch.transforms import compile, fp8, loop, memory, modules, precision  # noqa: F401
from composable_atorch.transforms.parallel import data_parallel, deepspeed, sharding  # noqa: F401

"""Registry-matrix cases for the data-parallel family (world 2, one spawned gloo group).

The DeepSpeed backends are configs of zero1 / zero2 / fsdp, not registered transforms; they are
covered by test_deepspeed.py in their own single group (their engine start is slow).
"""

from composable_atorch import ddp, fsdp, parallel_mode, zero1, zero2
from composable_atorch.models import Block

from matrix import Case

CASES = {
    "parallel_mode": Case(lambda: parallel_mode([("data", 2)]), world=2),
    "ddp": Case(lambda: ddp(), world=2),
    "zero1": Case(lambda: zero1(), world=2),
    "zero2": Case(lambda: zero2(), world=2),
    "fsdp": Case(lambda: fsdp(wrap=(Block,)), world=2),
}

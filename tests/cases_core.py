"""Registry-matrix cases for the core transforms (see test_matrix.py for the contract)."""

from composable_atorch import accumulate, amp, checkpoint, clip_grad, half
from composable_atorch.models import Block

from matrix import Case

CASES = {
    "amp": Case(lambda: amp("bf16")),
    "half": Case(lambda: half("bf16")),
    "checkpoint": Case(lambda: checkpoint(Block)),
    "accumulate": Case(lambda: accumulate(2)),
    "clip_grad": Case(lambda: clip_grad(1.0)),
}

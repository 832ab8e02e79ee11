"""composable_atorch: compose PyTorch training optimizations as checked, ordered, reusable plans.

    plan = fsdp(wrap=(Block,)) | amp("bf16") | checkpoint(Block)
    print(plan.explain())
    model, optim, loader = plan(model, optim, loader)
"""

from . import errors, strategy
from .compose import compose
from .contract import Contract, Stage
from .environment import Environment
from .plan import Plan, Step, build
from .transform import Transform, TrainState, registry
from .transforms.loop import accumulate, clip_grad
from .transforms.memory import checkpoint
from .transforms.precision import amp, amp_native, half

__version__ = "0.1.0"

__all__ = [
    "Contract",
    "Environment",
    "Plan",
    "Stage",
    "Step",
    "Transform",
    "TrainState",
    "accumulate",
    "amp",
    "amp_native",
    "build",
    "checkpoint",
    "clip_grad",
    "compose",
    "errors",
    "half",
    "registry",
    "strategy",
]

"""composable_atorch: compose PyTorch training optimizations as checked, ordered, reusable plans.

    plan = fsdp(wrap=(Block,)) | amp("bf16") | checkpoint(Block)
    print(plan.explain())
    model, optim, loader = plan(model, optim, loader)
"""

from . import errors, strategy
from .checkpointing import load_state, save_state
from .compose import compose
from .contract import Contract, Stage
from .environment import Environment
from .facade import auto_accelerate
from .plan import Plan, Step, build
from .resumable import resumable
from .transform import TrainState, Transform, registry
from .transforms.compile import compile_ as compile  # noqa: A004 - the package's own name, not the builtin
from .transforms.data_parallel import ddp, parallel_mode, zero1
from .transforms.fp8 import fp8
from .transforms.loop import accumulate, clip_grad
from .transforms.memory import checkpoint
from .transforms.modules import module_replace, register_replace_pair
from .transforms.precision import amp, amp_native, half
from .transforms.sharding import fsdp, zero2

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
    "auto_accelerate",
    "build",
    "checkpoint",
    "clip_grad",
    "compile",
    "compose",
    "errors",
    "fp8",
    "half",
    "module_replace",
    "registry",
    "register_replace_pair",
    "strategy",
    "ddp",
    "fsdp",
    "parallel_mode",
    "zero1",
    "zero2",
    "load_state",
    "resumable",
    "save_state",
]

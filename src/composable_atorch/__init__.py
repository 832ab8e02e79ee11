"""composable_atorch: compose PyTorch training optimizations as checked, ordered, reusable plans.

plan = fsdp(wrap=(Block,)) | amp("bf16") | checkpoint(Block)
print(plan.explain())
model, optim, loader = plan(model, optim, loader)
"""

from composable_atorch import errors, estimate, strategy
from composable_atorch.compat.accelerate import auto_accelerate
from composable_atorch.core.compose import compose
from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.plan import Plan, Step, build
from composable_atorch.core.transform import TrainState, Transform, registry
from composable_atorch.environment import Environment
from composable_atorch.estimate import estimate_plan
from composable_atorch.runtime.mesh import create_parallel_group, init_distributed
from composable_atorch.runtime.record_init import record_module_init
from composable_atorch.runtime.resumable import resumable
from composable_atorch.runtime.train_step import train_step
from composable_atorch.state.load import load_state
from composable_atorch.state.restarts import report_resumed
from composable_atorch.state.save import save_state, wait_for_saves
from composable_atorch.transforms.compile import compile_ as compile  # noqa: A004 - the package's own name, not the builtin
from composable_atorch.transforms.fp8 import fp8
from composable_atorch.transforms.loop import accumulate, clip_grad
from composable_atorch.transforms.memory import checkpoint
from composable_atorch.transforms.modules import module_replace, register_replace_pair
from composable_atorch.transforms.parallel.data import ddp, fsdp, parallel_mode, zero1, zero2
from composable_atorch.transforms.parallel.ds3d import DeepSpeed3DParallelConfig, ds_3d_parallel
from composable_atorch.transforms.parallel.expert import expert_parallel
from composable_atorch.transforms.parallel.mixed import mixed_parallel
from composable_atorch.transforms.parallel.pipeline import pipeline_parallel
from composable_atorch.transforms.parallel.sequence import context_parallel, sequence_cross_entropy, sequence_parallel
from composable_atorch.transforms.parallel.tensor import TPInfo, tensor_parallel
from composable_atorch.transforms.precision import amp, amp_native, half

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
    "estimate",
    "estimate_plan",
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
    "TPInfo",
    "tensor_parallel",
    "sequence_parallel",
    "context_parallel",
    "sequence_cross_entropy",
    "pipeline_parallel",
    "mixed_parallel",
    "expert_parallel",
    "train_step",
    "init_distributed",
    "create_parallel_group",
    "record_module_init",
    "DeepSpeed3DParallelConfig",
    "ds_3d_parallel",
    "load_state",
    "report_resumed",
    "resumable",
    "save_state",
    "wait_for_saves",
]

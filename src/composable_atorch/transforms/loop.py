"""The training loop's own transforms: gradient accumulation and gradient clipping.

Both act through the returned optimizer (``optim.backward / step / zero_grad``), so the user's
loop does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.loader import loader_batch_size, rebuild_loader, split_batch
from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.transforms.parallel.shared.grads import clip_grads_


class AccumulateHook(OptimizerHook):
    """Average the loss over ``steps`` micro-batches; the optimizer steps on the last one.

    A plain ``loss.backward()`` would sum instead of average (``steps`` times too large a step):
    ``needs_loss_hook``, so such a step raises rather than trains wrongly.
    """

    def __init__(self, steps: int):
        self.accumulation_steps = steps
        self.needs_loss_hook = steps > 1

    def scale_loss(self, loss):
        return loss / self.accumulation_steps


@dataclass(frozen=True)
class Accumulate(Transform):
    """Split each global batch into ``steps`` micro-batches and step once per global batch.

    The loader's batch size stays the global batch: the rebuilt loader yields micro-batches of
    ``batch / steps`` (per rank, after data parallelism), and the optimizer steps every ``steps``
    of them, so the update equals one step on the whole batch while activations shrink.
    Data-parallel transforms skip gradient sync between boundaries.
    """

    name = "accumulate"
    contract = Contract(stage=Stage.OPTIMIZER, roles=("accumulation",))

    steps: int = 1

    def __post_init__(self):
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise ConfigError("accumulate.steps", self.steps, "an integer >= 1")

    @classmethod
    def candidates(cls, search):
        """2 and 4 micro-batches where they divide each rank's share of the global batch; on paper
        (``search.on_paper``, where a plan costs an estimate, not a trial) every power of two that
        does, down to micro-batches of one sample (the largest micro-batch that fits is the search's)."""
        per_rank = search.batch_size // max(1, search.env.world_size)
        steps = (2, 4) if not search.on_paper else tuple(2**i for i in range(1, per_rank.bit_length()))
        return tuple(cls(steps=k) for k in steps if per_rank % k == 0 and per_rank >= k)

    def describe(self):
        return f"accumulate({self.steps} micro-batches per step)"

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        steps = self.steps
        if state.loader is not None and steps > 1:
            share = loader_batch_size(state.loader)  # this rank's share of the global batch
            whole = getattr(state.loader, "global_batch_size", share)
            if whole % steps == 0:  # valid for the global batch: only this world's split does not divide
                steps = refit_steps(share, steps)
            if steps != self.steps:
                state.note(
                    self.name,
                    f"{self.steps} micro-batches do not divide this rank's share of {share} (the global batch over "
                    f"this world's data ranks): {steps} micro-batches of {share // steps} instead, so the global "
                    "batch and the update stay the same",
                )
            micro = split_batch(state.loader, steps, what="accumulate.steps")
            state.loader = rebuild_loader(state.loader, batch_size=micro)
            state.note(self.name, f"loader yields micro-batches of {micro}; the optimizer steps every {steps}")
        state.hooks.append(AccumulateHook(steps))
        return state


def refit_steps(share: int, steps: int) -> int:
    """The accumulation steps for a per-rank share of the global batch: ``steps`` when it divides, else
    the smallest divisor of the share above it (micro-batches no larger than planned: the memory the
    plan was sized for), or the share itself (micro-batches of 1). An elastic restart at another data
    size changes the share; the global batch, and so the math, is kept."""
    if share % steps == 0:
        return steps
    return min(d for d in range(1, share + 1) if share % d == 0 and d >= min(steps, share))


def accumulate(steps: int) -> Accumulate:
    return Accumulate(steps=steps)


class ClipHook(OptimizerHook):
    """Clip the whole model's gradient norm just before the step (after any unscaling).

    ``parallel`` is the plan's ParallelContext, read at each step: the norm is the one process's,
    over DTensor shards (FSDP2, tensor parallel) and plain gradients mixed, and summed over a
    pipeline's stages (:func:`~composable_atorch.transforms.parallel.shared.grads.grad_norm`);
    clipping each stage by its own norm would train otherwise than one process, silently."""

    def __init__(self, max_norm: float, norm_type: float, parallel=None):
        self.max_norm, self.norm_type, self.parallel = max_norm, norm_type, parallel
        self.last_norm: torch.Tensor | None = None

    def before_step(self, optimizer):
        own = getattr(optimizer, "clip_grad_norm", None)
        if callable(own):
            # an optimizer that shards gradients outside DTensor (fairscale OSS) knows the global norm
            self.last_norm = own(self.max_norm, norm_type=self.norm_type)
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.last_norm = clip_grads_(params, self.max_norm, self.norm_type, self.parallel)


@dataclass(frozen=True)
class ClipGrad(Transform):
    """Clip gradients to a global norm of at most ``max_norm`` before every optimizer step."""

    name = "clip_grad"
    contract = Contract(stage=Stage.OPTIMIZER, roles=("clipping",))

    max_norm: float = 1.0
    norm_type: float = 2.0

    def __post_init__(self):
        for field, value in (("clip_grad.max_norm", self.max_norm), ("clip_grad.norm_type", self.norm_type)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(field, value, "a positive number")
        object.__setattr__(self, "max_norm", float(self.max_norm))
        object.__setattr__(self, "norm_type", float(self.norm_type))

    def describe(self):
        return f"clip_grad(max_norm={self.max_norm:g}" + (
            ")" if self.norm_type == 2.0 else f", norm_type={self.norm_type:g})"
        )

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        if any(h.clips_gradients for h in state.hooks):
            state.note(
                self.name, "an engine earlier in the plan clips with this max_norm itself; no second clipping hook"
            )
            return state
        state.hooks.append(ClipHook(self.max_norm, self.norm_type, state.parallel))
        return state


def clip_grad(max_norm: float, *, norm_type: float = 2.0) -> ClipGrad:
    return ClipGrad(max_norm=max_norm, norm_type=norm_type)

"""Cutting a model into pipeline stages at block boundaries (pure module surgery, no processes).

The built-in GPT is cut into stage modules of its own (:class:`_GPTStage`); any other model with a
block list by :mod:`.cutter` (the model itself, cut in place, its own forward running on each
stage). A rank holds one stage, or several ("virtual" stages of an interleaved / V schedule); then
the module the user gets holds all of them under their original parameter names and each stage is
a separate view sharing its parameters (for the generic cutter: a copy of the module tree sharing
every parameter and buffer, cut in place), so torch's schedule runs each stage's own blocks.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from composable_atorch.errors import CompositionError
from composable_atorch.transforms.parallel.pipeline.anatomy import Anatomy, anatomy_of
from composable_atorch.transforms.parallel.pipeline.cutter import cut_stage, hold, share


class PipelineLoopError(CompositionError, RuntimeError):
    """A pipeline stage called like a whole model (the plain loop would train one stage only)."""

    def __init__(self):
        super().__init__(
            "this model is one stage of a pipeline-parallel plan; calling it as model(x) would run one stage only. "
            "Fix: train with composable_atorch.train_step(model, optim, inputs, targets, loss_fn), which runs the "
            "pipeline schedule (it trains every plan, pipeline or not)."
        )


# ---------------------------------------------------------------------------------------------
# cutting the model
# ---------------------------------------------------------------------------------------------


def _is_builtin_gpt(model) -> bool:
    return all(hasattr(model, a) for a in ("tok", "pos", "blocks", "ln_f", "head")) and isinstance(
        model.blocks, nn.ModuleList
    )


KNOWN_MODELS = (
    "composable_atorch's GPT, any HF causal LM, or a model holding its repeated blocks in an nn.ModuleList / "
    "nn.Sequential (see pipeline.cutter)"
)


def anatomy_full(model: nn.Module, split_paths: tuple[str, ...] = ()) -> Anatomy | None:
    """The generic cutter's view of ``model``; None for the built-in GPT (cut by :class:`_GPTStage`)."""
    if _is_builtin_gpt(model) and not split_paths:
        return None
    return anatomy_of(model, split_paths)


def anatomy(model: nn.Module, split_paths: tuple[str, ...] = ()) -> tuple[list[nn.Module], int, int]:
    """(blocks, parameters outside blocks on the first stage, on the last stage); typed errors for what
    cannot be cut."""
    an = anatomy_full(model, split_paths)
    if an is None:
        return list(model.blocks), numel(model.tok) + numel(model.pos), numel(model.ln_f) + numel(model.head)
    return (an.blocks, *an.weights(model))


class StageGuard:
    """Refuses a stage's forward outside its schedule once the runner is armed (the stage checks run it
    before). The runner holds it and says when its schedule runs; the stage's forward calls it."""

    def __init__(self):
        self.armed = False
        self.running = False

    def __call__(self, stage: nn.Module) -> None:
        if self.armed and not self.running:
            raise PipelineLoopError()

    def __deepcopy__(self, memo):  # a copy of a stage (a probe's replica) runs on its own
        return StageGuard()


def numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def balanced_cuts(weights: list[int], stages: int, head: int = 0, tail: int = 0) -> tuple[int, ...]:
    """Start indices of stages 1.. over ``weights`` (blocks), minimising the largest stage.

    ``head`` / ``tail`` are the weights the first / last stage carry besides blocks.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i, j, s):  # blocks i..j-1 as stage s
        return prefix[j] - prefix[i] + (head if s == 0 else 0) + (tail if s == stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                c = max(best[s - 1][i], cost(i, j, s - 1))
                if c < best[s][j]:
                    best[s][j], arg[s][j] = c, i
    cuts, j = [], n
    for s in range(stages, 0, -1):
        j = arg[s][j]
        cuts.append(j)
    return tuple(sorted(cuts)[1:])


class _GPTStage(nn.Module):
    """One stage of the built-in GPT, its submodules under their original names."""

    def __init__(self, model: nn.Module, first: bool, last: bool, blocks: range, guard: StageGuard | None = None):
        super().__init__()
        self.guard = guard or StageGuard()
        if first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.ln_f, self.head = model.ln_f, model.head
        self.first, self.last = first, last

    def forward(self, x):
        self.guard(self)
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def _holder_forward(self, *args, **kwargs):
    """The module a rank with several stages keeps holds them all; only the schedule runs them."""
    raise PipelineLoopError()


def rank_modules(
    model: nn.Module, bounds: tuple[int, ...], local: list[int], an: Anatomy | None = None, guard=None
) -> tuple[nn.Module, list[nn.Module]]:
    """(the module this rank keeps, one module per local stage) for stages ``local`` of ``bounds``.

    One stage per rank: the kept module is the stage, its forward guarded by ``guard`` (a :class:`StageGuard`
    the runner arms). Several: the kept module holds all of this rank's pieces (names unchanged; its own
    forward always refuses) and each stage is a view over its own pieces only.
    """
    guard = guard or StageGuard()
    n = len(bounds) - 1
    ranges = {s: range(bounds[s], bounds[s + 1]) for s in local}
    if len(local) == 1:
        s = local[0]
        if an is None:
            stage = _GPTStage(model, s == 0, s == n - 1, ranges[s], guard)
        else:
            stage = cut_stage(model, an, s == 0, s == n - 1, ranges[s], guard)
        return stage, [stage]
    if an is not None:
        stages = [cut_stage(share(model), an, s == 0, s == n - 1, ranges[s], StageGuard()) for s in local]
        hold(model, an, 0 in local, n - 1 in local, [i for s in local for i in ranges[s]])
        model.forward = types.MethodType(_holder_forward, model)
        return model, stages
    union = [i for s in local for i in ranges[s]]
    kept = _GPTStage(model, 0 in local, n - 1 in local, sorted(union), guard)  # never run by the schedule
    return kept, [_GPTStage(model, s == 0, s == n - 1, ranges[s]) for s in local]

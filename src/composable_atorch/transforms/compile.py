"""compile: ``torch.compile`` per repeated block (the default) or for the whole model, in place.

In place means ``module.compile(...)``: the module keeps its parameters and their names.
``torch.compile(model)`` would return an ``OptimizedModule`` whose names gain ``_orig_mod.``.
Per block (after checkpointing, before sharding, per DESIGN.md) keeps each graph small and lets
FSDP's hooks sit between compiled blocks instead of breaking one big graph.

Blocks are found as: the classes given in ``per_block``; with ``per_block=True`` a transformers
model's ``_no_split_modules`` (its decoder layers), else the class repeated most often inside an
``nn.ModuleList``. ``per_block=False`` compiles the whole model.

Named ``compile_`` / ``Compile`` inside the package so the builtin ``compile`` is not shadowed;
the package exports it as ``compile``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from composable_atorch.core.contract import Conflict, Contract, Cost, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.transforms._util import is_block_target, outermost_matches

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _target_name(t) -> str:
    return t.__name__ if isinstance(t, type) else t


def repeated_blocks(model: nn.Module) -> tuple[type, ...]:
    """The model's repeated block classes: transformers' ``_no_split_modules``, else the ModuleList favourite."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        found = tuple(dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in no_split))
        if found:
            return found
    counts = Counter(type(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m)
    repeated = [(n, cls) for cls, n in counts.items() if n >= 2]
    return (max(repeated, key=lambda item: item[0])[1],) if repeated else ()


#: the backends that fuse a graph's ops into generated kernels (the others run the captured graph's
#: ops one by one, as the eager step does)
FUSING_BACKENDS = ("inductor",)


@dataclass(frozen=True)
class CompiledRegions:
    """What a compile step compiles, as the estimate needs it (it simulates the eager step in its
    place and prices these modules' forward and backward as compiled: ``estimate.steptime``)."""

    #: the modules compiled in place (the whole model when no blocks are found or asked for)
    modules: tuple[nn.Module, ...]
    #: True when the backend fuses their ops into generated kernels (inductor)
    fuses: bool
    #: the step, as explain() writes it
    what: str


@dataclass(frozen=True)
class Compile(Transform):
    """``torch.compile`` in place, per block or whole model (see the module docstring)."""

    name = "compile"
    contract = Contract(
        stage=Stage.COMPILE,
        roles=("compile",),
        # the estimate never runs the compiler on its fake tensors (inductor generates and runs real
        # kernels there): it simulates the eager step and prices the regions as compiled
        cost=Cost(compiles=True),
        conflicts=(
            Conflict(
                "checkpoint",
                "compiling the whole model traces through the checkpointed blocks' hooks, and torch's recompute then "
                "sees other tensors than the forward saved (CheckpointError in the first backward)",
                "compile per block (compile(per_block=True), the default), or drop checkpoint",
                when=lambda mine, _checkpoint: mine.per_block is False,
            ),
        ),
    )

    backend: str = "inductor"
    mode: str | None = None
    per_block: bool | tuple = True
    fullgraph: bool = False
    dynamic: bool | None = None

    def __post_init__(self):
        backends = torch.compiler.list_backends(exclude_tags=())
        if not isinstance(self.backend, str) or self.backend not in backends:
            raise ConfigError(
                "compile.backend",
                self.backend,
                "a registered torch.compile backend name, e.g. 'inductor' or 'aot_eager' (one of "
                f"{', '.join(backends)})",
            )
        if self.mode not in MODES:
            raise ConfigError("compile.mode", self.mode, ", ".join(repr(m) for m in MODES))
        if self.mode is not None and self.backend != "inductor":
            raise ConfigError("compile.mode", self.mode, f"None with backend {self.backend!r} (modes are inductor's)")
        per_block = self.per_block
        if not isinstance(per_block, bool):
            per_block = (per_block,) if isinstance(per_block, type | str) else per_block
            try:
                per_block = tuple(per_block)
            except TypeError:
                raise ConfigError(
                    "compile.per_block", self.per_block, "True, False, or block classes / class names / module names"
                ) from None
            if not per_block or not all(is_block_target(t) for t in per_block):
                raise ConfigError(
                    "compile.per_block", self.per_block, "True, False, or block classes / class names / module names"
                )
            object.__setattr__(self, "per_block", per_block)
        if not isinstance(self.fullgraph, bool):
            raise ConfigError("compile.fullgraph", self.fullgraph, "True or False")
        if self.dynamic not in (None, True, False):
            raise ConfigError("compile.dynamic", self.dynamic, "None, True or False")

    @classmethod
    def candidates(cls, search):
        """None unless the search allows compiling: a cold inductor compile costs minutes per trial.

        When allowed, one candidate: inductor per block (the search's block classes, else detected).
        """
        if not search.allow_compile:
            return ()
        return (cls(backend="inductor", per_block=tuple(search.block_classes) or True),)

    def sort_key(self):
        blocks = self.per_block if isinstance(self.per_block, bool) else tuple(_target_name(t) for t in self.per_block)
        return (
            int(self.contract.stage),
            self.name,
            repr((self.backend, self.mode, blocks, self.fullgraph, self.dynamic)),
        )

    def describe(self):
        if self.per_block is True:
            where = "per repeated block"
        elif self.per_block is False:
            where = "whole model"
        else:
            where = "per " + ", ".join(_target_name(t) for t in self.per_block)
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("mode", "dynamic") if getattr(self, k) is not None)
        return f"compile({self.backend}, {where}{', fullgraph' if self.fullgraph else ''}{extra})"

    def targets(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of the blocks compiled in place, or ``[]`` for the whole model; a
        ``per_block`` matching nothing is a ConfigError."""
        targets = self.per_block
        if targets is True:
            targets = repeated_blocks(model)
        if not targets:
            return []
        found = outermost_matches(model, targets)
        if not found:
            raise ConfigError(
                "compile.per_block",
                tuple(_target_name(t) for t in targets),
                f"classes or names of modules in {type(model).__name__} (none matched)",
            )
        return found

    def regions(self, model: nn.Module) -> CompiledRegions:
        """What :meth:`apply` would compile in ``model``, compiling nothing (for the estimate)."""
        found = self.targets(model)
        modules = tuple(m for _, m in found) if found else (model,)
        return CompiledRegions(modules, self.backend in FUSING_BACKENDS, self.describe())

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        model = state.model
        kwargs = {"backend": self.backend, "mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        found = self.targets(model)
        if found:
            for _, module in found:
                module.compile(**kwargs)
            kinds = sorted({type(m).__name__ for _, m in found})
            state.note(
                self.name,
                f"{len(found)} block(s) compiled in place ({', '.join(kinds)}; backend {self.backend}); parameter "
                "names unchanged",
            )
        else:
            if self.per_block is True:
                state.note(self.name, f"no repeated blocks found in {type(model).__name__}: compiling the whole model")
            model.compile(**kwargs)
            state.note(
                self.name,
                f"{type(model).__name__} compiled in place (backend {self.backend}); parameter names unchanged",
            )
        return state


def compile_(
    backend: str = "inductor",
    *,
    mode: str | None = None,
    per_block=True,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> Compile:
    """``torch.compile`` in place.

    ``compile(per_block=(Block,))``, ``compile(backend="aot_eager", per_block=False)``.
    """
    return Compile(backend=backend, mode=mode, per_block=per_block, fullgraph=fullgraph, dynamic=dynamic)

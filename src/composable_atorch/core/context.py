"""What a transform sees and maps: the :class:`TrainState` flowing through a plan, the read-only
:class:`ApplyContext` of the plan being applied, and the :class:`SearchContext` the auto search
asks candidates with.

Plain data, below the Transform base class and the plan, so both can use it without importing
each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from composable_atorch.runtime.mesh import ParallelContext
    from composable_atorch.runtime.optim import OptimizerHook, StepRunner


@dataclass
class TrainState:
    """What flows through a plan: the triple, plus what travels with it.

    ``optim`` is the user's (inner) optimizer — the plan wraps it with the collected ``hooks`` at
    the end. ``parallel`` holds process groups / device meshes made by parallel transforms (a
    :class:`~composable_atorch.runtime.mesh.ParallelContext`); ``runner`` the pipeline runner a
    pipeline step returned (``train_step`` drives it: it travels on the plan's optimizer).
    ``param_names`` maps ``id(param)`` of every parameter the user's optimizer held to its
    canonical name, so any step that replaces parameters can have the optimizer rebuilt by name.
    """

    model: torch.nn.Module
    optim: Any = None
    loader: Any = None
    parallel: ParallelContext | None = None
    runner: StepRunner | None = None
    hooks: list[OptimizerHook] = field(default_factory=list)
    param_names: dict[int, str] = field(default_factory=dict)
    #: Free-form records transforms leave for explain() after application (what was swapped...).
    report: dict[str, list[str]] = field(default_factory=dict)

    def note(self, transform: str, line: str) -> None:
        self.report.setdefault(transform, []).append(line)


@dataclass(frozen=True)
class SearchContext:
    """What the auto search knows when it asks each transform for candidate configs.

    ``block_classes`` are the model's repeated blocks (candidates for checkpoint / fsdp wrap /
    compile); ``batch_size`` is the global batch; ``env`` the target environment (its world size
    is the one the trial will run at). ``allow_compile`` lets compile offer candidates: a cold
    inductor compile costs minutes per trial on a small CPU, so the search opts in.
    """

    env: Environment
    block_classes: tuple[type, ...] = ()
    batch_size: int = 1
    allow_compile: bool = False


class PlanView(Protocol):
    """What a transform may see of the plan being applied: its transforms, in order."""

    @property
    def transforms(self) -> tuple[Any, ...]: ...  # the plan's Transforms


@dataclass(frozen=True)
class ApplyContext:
    """Read-only view of the plan being applied: its environment and its other steps.

    ``reader`` is the transform being applied; it may read only the transforms its contract
    declares in ``reads`` (None: an unchecked context, for tests of a helper on its own).
    """

    #: the Plan being applied (core.plan sits above this module; only ``.transforms`` is read here)
    plan: PlanView
    env: Environment
    strict: bool = False
    reader: Any = None  # the Transform being applied

    def for_step(self, transform: Any) -> ApplyContext:
        return dataclasses.replace(self, reader=transform)

    def find(self, name: str) -> Any:
        """The transform of this kind in the plan, if any (e.g. fsdp reads amp's dtype).

        ConfigError when the reader's contract does not declare ``name`` in ``reads``: what a
        step depends on is data, so explain() and the search can see it.
        """
        if self.reader is not None and name not in self.reader.contract.reads:
            declared = ", ".join(self.reader.contract.reads) or "nothing"
            raise ConfigError(
                f"{self.reader.name}.contract.reads",
                name,
                f"declare every transform a step reads in its contract, e.g. Contract(..., reads=({name!r},)) "
                f"(declared: {declared})",
            )
        return next((t for t in self.plan.transforms if t.name == name), None)

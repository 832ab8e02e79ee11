"""What a transform sees and maps: the :class:`TrainState` flowing through a plan, the read-only
:class:`ApplyContext` of the plan being applied, and the :class:`SearchContext` the auto search
asks candidates with (with :class:`ModelFacts`, and the :class:`LayoutOption` / :class:`NotOffered`
an axis answers with).

Plain data, below the Transform base class and the plan, so both can use it without importing
each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
class ForwardProfile:
    """What one forward (and loss) of the model on the meta device over the first batch shows: the bytes
    saved for the backward (activations; not the parameters) and the heads of every
    ``scaled_dot_product_attention`` call; ``error`` when it could not run (a data-dependent forward,
    e.g. a mixture of experts routing tokens)."""

    activation_bytes: int | None = None
    heads: tuple[int, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What the search read from the model and the workload's first batch, once, for the candidates that
    depend on them: a sequence split on attention and long sequences, expert degrees on MoE layers.

    ``model`` is the example model (on the meta device where it builds there): an axis that must look
    at its layers (its experts) does. ``sequence_length`` is dim 1 of the batch's first tensor (None
    when it has no ``(batch, sequence)`` tensor). :meth:`profile` runs ``measure`` — one forward of the
    user's model on the meta device — on first use and keeps it: it runs the user's code, so only for
    an axis that asks, and once for all of them.
    """

    model: Any = None
    sequence_length: int | None = None
    parameter_bytes: int = 0
    measure: Callable[[], ForwardProfile] | None = field(default=None, repr=False, compare=False)
    _measured: list = field(default_factory=list, repr=False, compare=False)

    def profile(self) -> ForwardProfile:
        if not self._measured:
            self._measured.append(self.measure() if self.measure is not None else ForwardProfile(error="not measured"))
        return self._measured[0]

    @property
    def profiled(self) -> ForwardProfile | None:
        """The profile when an axis asked for it, else None (the forward never ran)."""
        return self._measured[0] if self._measured else None


@dataclass(frozen=True)
class LayoutOption:
    """A degree an axis offers the search: its ``steps`` over ``dim`` of size ``degree``, with the
    ``parallel_mode`` ``layout`` they run on, as one option of the search's ``parallel_mode`` knob
    (the step's own config does not vary: its degree is the mesh's). ``label`` says in one line what
    the option does. ``admit(plan) -> reason | None`` is a rule on every plan of the space while the
    option is offered (hybrid sharding's layout refuses the plans that would list it twice)."""

    label: str
    layout: Any  # a parallel_mode Transform
    steps: tuple[Any, ...] = ()
    dim: str = ""
    degree: int = 1
    admit: Callable[[Any], str | None] | None = field(default=None, compare=False)

    @property
    def transforms(self) -> tuple[Any, ...]:
        return (self.layout, *self.steps)


@dataclass(frozen=True)
class NotOffered:
    """Why an axis offers no degree (or not this one) for this model, batch and world: the search
    says it under its trials table (``"<subject> not proposed: <reason>"``)."""

    subject: str
    reason: str

    @property
    def note(self) -> str:
        return f"{self.subject} not proposed: {self.reason}"


@dataclass(frozen=True)
class SearchContext:
    """What the auto search knows when it asks each transform for candidate configs.

    ``block_classes`` are the model's repeated blocks (candidates for checkpoint / fsdp wrap /
    compile); ``batch_size`` is the global batch; ``env`` the target environment (its world size
    is the one the trial will run at). ``allow_compile`` lets compile offer candidates: a cold
    inductor compile costs minutes per trial on a small CPU, so the search opts in.

    ``model`` (:class:`ModelFacts`) is what the model and its first batch show, for an axis whose
    degrees depend on them: it answers with :class:`LayoutOption` (and :class:`NotOffered`) among its
    candidates; None offers no such degree. ``included`` are the kinds the user pinned: an axis
    included there offers every degree it can train, not only those it judges worth measuring.

    ``on_paper``: the search prices plans with the estimate for ``env`` (a cluster it does not run on)
    instead of measuring trials here, so a plan costs seconds, not a run: an axis may offer what a
    trial on this machine could not afford or express (tensor x data layouts for a sharded engine,
    every pipeline schedule, micro-batches down to one sample).
    """

    env: Environment
    block_classes: tuple[type, ...] = ()
    batch_size: int = 1
    allow_compile: bool = False
    model: ModelFacts | None = None
    included: frozenset[str] = frozenset()
    on_paper: bool = False

    @property
    def degrees(self) -> tuple[int, ...]:
        """The sizes a mesh dimension may take in this world: its divisors from 2."""
        world = self.env.world_size
        return tuple(n for n in range(2, world + 1) if world % n == 0)


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

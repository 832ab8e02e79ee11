"""Contracts: what each transform declares about itself, as data.

A contract says where a transform sits in the canonical order (:class:`Stage`), what it needs
from the environment (:class:`Requirement`), what it cannot be combined with
(:class:`Conflict`), extra pairwise ordering (:class:`Order`), roles only one transform may own
(``owns``), and transforms it implies (:class:`Implication`). compose() reads only these; no
ordering or compatibility rule lives in an if-chain elsewhere.

A contract that names the mesh axis it owns (``axis=TENSOR``, see :mod:`composable_atorch.runtime.axes`)
gets the rules every axis owner shares from the axis rules below (:func:`axis_rules`): the world-size
requirement, the implied ``parallel_mode`` with the axis's dimension, and the conflict with a
``parallel_mode`` that lacks it; compose()'s :func:`~.passes.unused_axes` adds the reverse (a dimension
> 1 that no step uses).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.environment import Environment
from composable_atorch.runtime.axes import DATA, Axis


class Stage(enum.IntEnum):
    """The canonical order. Each value's docstring-like reason is in :data:`STAGE_REASONS`."""

    PROCESS_GROUPS = 0
    MODULE_REWRITE = 1
    HALF_CAST = 2
    TENSOR_PARALLEL = 3
    PIPELINE_SPLIT = 4
    CHECKPOINT = 5
    COMPILE = 6
    DATA_PARALLEL = 7
    FORWARD_PRECISION = 8
    OPTIMIZER = 9


STAGE_REASONS: dict[Stage, str] = {
    Stage.PROCESS_GROUPS: "process groups and the device mesh exist before anything shards over them",
    Stage.MODULE_REWRITE: "module rewrites must see the user's original classes before any wrapper hides them",
    Stage.HALF_CAST: "cast before sharding so shards are born in the training dtype",
    Stage.TENSOR_PARALLEL: "shard Linear weights into DTensors before anything wraps the blocks",
    Stage.PIPELINE_SPLIT: "stages are cut from the rewritten, tensor-parallel model",
    Stage.CHECKPOINT: "wrap blocks before compile and sharding",
    Stage.COMPILE: "compile per block after checkpointing and before sharding, so graphs don't break on FSDP hooks",
    Stage.DATA_PARALLEL: "data parallel / sharding is the outermost module wrapper",
    Stage.FORWARD_PRECISION: "autocast wraps the outermost forward",
    Stage.OPTIMIZER: "optimizer-side steps rebind the final parameters and wrap the step",
}


# ---------------------------------------------------------------------------------------------
# Requirements
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Requirement:
    """Something the environment must provide. Fields are keyword-only: ``Package(name="deepspeed")``.

    ``on_unmet`` is ``"error"`` (compose raises RequirementError) or ``"skip"`` (the step is left
    out of the plan, the reason shows in explain(), and ``strict=True`` raises instead).
    """

    on_unmet: str = "error"

    def unmet(self, env: Environment, transform: Any) -> str | None:
        """What is missing, or None when satisfied. ``transform`` is the (resolved) Transform being
        checked, or None outside a plan."""
        raise NotImplementedError

    def fix(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        """What is required, for explain() (e.g. "a cuda device")."""
        return type(self).__name__


@dataclass(frozen=True, kw_only=True)
class MinWorldSize(Requirement):
    minimum: int = 2

    def unmet(self, env, transform):
        if env.world_size < self.minimum:
            return f"a world size of at least {self.minimum} (this environment has {env.world_size})"
        return None

    def describe(self):
        return f"world size >= {self.minimum}"

    def fix(self):
        return (
            f"launch with at least {self.minimum} processes, e.g. `python -m composable_atorch launch --nproc "
            f"{self.minimum} train.py`"
        )


@dataclass(frozen=True, kw_only=True)
class DeviceKind(Requirement):
    kinds: tuple[str, ...] = ("cuda",)

    def unmet(self, env, transform):
        if env.device not in self.kinds:
            return f"a {' or '.join(self.kinds)} device (this environment is {env.device})"
        return None

    def describe(self):
        return f"a {' or '.join(self.kinds)} device"

    def fix(self):
        return f"run on a {' or '.join(self.kinds)} machine, or drop this transform"


@dataclass(frozen=True, kw_only=True)
class MinComputeCapability(Requirement):
    major: int = 8
    minor: int = 0

    def unmet(self, env, transform):
        cc = env.compute_capability
        if cc is None or tuple(cc) < (self.major, self.minor):
            have = "no GPU" if cc is None else f"sm{cc[0]}{cc[1]}"
            return f"a CUDA GPU of compute capability >= {self.major}.{self.minor} (this environment has {have})"
        return None

    def describe(self):
        return f"compute capability >= {self.major}.{self.minor}"

    def fix(self):
        return f"use a GPU of compute capability {self.major}.{self.minor} or newer, or drop this transform"


@dataclass(frozen=True, kw_only=True)
class Package(Requirement):
    name: str = ""
    extra: str | None = None

    def unmet(self, env, transform):
        return None if env.has(self.name) else f"the package {self.name!r}"

    def describe(self):
        return f"package {self.name}"

    def fix(self):
        if self.extra:
            return f"pip install 'composable_atorch[{self.extra}]' -c constraints.txt"
        return f"pip install {self.name}"


@dataclass(frozen=True, kw_only=True)
class When(Requirement):
    """A requirement that applies only for some configs: ``When(pred, inner)``.

    ``predicate(transform)`` says whether ``inner`` applies, e.g. only the DeepSpeed backend of
    zero1 needs deepspeed.
    """

    predicate: Callable[[Any], bool] = lambda t: True
    inner: Requirement | None = None

    def unmet(self, env, transform):
        if self.inner is None or not self.predicate(transform):
            return None
        return self.inner.unmet(env, transform)

    def fix(self):
        return self.inner.fix() if self.inner else ""

    def describe(self):
        cond = getattr(self.predicate, "__doc__", None) or "some configs"
        return f"{self.inner.describe() if self.inner else 'nothing'} (when {cond.strip().rstrip('.')})"


@dataclass(frozen=True, kw_only=True)
class AllOf(Requirement):
    """Several requirements under one name: ``AllOf(name="transformer-engine", parts=(cuda, sm89, package))``.

    Unmet when any part is; the message names the first missing part.
    """

    name: str = ""
    parts: tuple[Requirement, ...] = ()

    def _first_unmet(self, env, transform) -> tuple[Requirement, str] | None:
        for part in self.parts:
            missing = part.unmet(env, transform)
            if missing is not None:
                return part, missing
        return None

    def unmet(self, env, transform):
        hit = self._first_unmet(env, transform)
        return None if hit is None else (f"{hit[1]}, for {self.name}" if self.name else hit[1])

    def fix(self):
        return "; ".join(p.fix() for p in self.parts)

    def describe(self):
        inner = " + ".join(p.describe() for p in self.parts)
        return f"{self.name} ({inner})" if self.name else inner


def unmet(requirements, env: Environment, transform=None) -> str | None:
    """The first unmet requirement's message among ``requirements``, or None."""
    for req in requirements:
        missing = req.unmet(env, transform)
        if missing is not None:
            return missing
    return None


# ---------------------------------------------------------------------------------------------
# Pairwise rules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conflict:
    """This transform cannot be combined with ``other`` (a transform name or an owned role).

    ``when(mine, theirs)``, if given, restricts the conflict to some configs (amp and half
    conflict only when their dtypes differ).
    """

    other: str
    reason: str
    fix: str
    when: Callable[[Any, Any], bool] | None = None


@dataclass(frozen=True)
class Order:
    """This transform must run after (``after=True``) or before ``other``, with the reason."""

    other: str
    reason: str
    after: bool = True


@dataclass(frozen=True)
class Implication:
    """This transform needs ``name`` in the plan; compose adds it (with ``config``) if absent.

    ``satisfied_by`` lists other transform names or roles that make the implication moot.
    """

    name: str
    reason: str
    config: dict = field(default_factory=dict)
    satisfied_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class DefaultOwner:
    """The declaring transform is the default owner of ``role`` where the environment meets ``when``.

    compose() reads it from every registered contract: a plan checked against such an environment
    in which nothing owns (or is tagged with) ``role`` gets the declaring transform, in its
    default config, with ``reason`` in explain(); ``strict=True`` raises instead. E.g. ddp is the
    default owner of ``grad_sync`` at world size >= 2: a plan of only amp / checkpoint there is
    not a distributed training plan (ranks would drift apart), so compose adds data parallelism.
    """

    role: str
    when: Requirement
    reason: str


@dataclass(frozen=True)
class Cost:
    """How a step changes a rank's memory, for ``composable_atorch.estimate`` (data only).

    The estimate runs each step in a fake world (meta/fake tensors, torch's fake process group) and
    lets torch's MemTracker see what it costs, so most steps need to say nothing. ``simulated=False``
    marks an engine that cannot run there (DDP's C++ reducer needs real storage, pipelining
    real send/recv): the estimate leaves it out and adds ``grad_copies`` extra copies of the
    local gradients it would hold (DDP's buckets), reported as temporary bytes; one that declares
    nothing to add (DeepSpeed's engines) makes the estimate refuse the plan (a typed error) rather
    than report a figure that is not the plan's. ``compiles=True`` marks a compiler (torch.compile):
    run on fake tensors it would generate and run real kernels, so the estimate simulates the eager
    step in its place and prices the step as compiled (``estimate.steptime``).
    """

    simulated: bool = True
    grad_copies: float = 0.0
    compiles: bool = False


# ---------------------------------------------------------------------------------------------
# Axis rules: what every owner of a mesh axis would otherwise write by hand
# ---------------------------------------------------------------------------------------------


def mesh_dim_implication(axis: Axis, reason: str) -> Implication:
    """parallel_mode with an ``(axis, 2)`` dimension, added when the plan has none: the data size then
    absorbs the rest of the world. A step that lays out the mesh itself (role ``process_groups``)
    makes it moot."""
    return Implication(
        "parallel_mode",
        reason,
        config={"groups": ((axis.name, 2), (DATA.name, 1))},
        satisfied_by=("process_groups",),
    )


def axis_world_size(axis: Axis) -> Requirement:
    """An axis's owner needs ``min_degree`` processes. Below that it is skipped with the reason, not
    refused: ATorch drops distributed methods in one process (remove_distributed_method), so one
    plan serves a laptop run and a launched one."""
    return MinWorldSize(minimum=axis.min_degree, on_unmet="skip")


def axis_mesh_dim(axis: Axis) -> Implication:
    """An axis's owner works over that dimension of parallel_mode's device mesh, so the plan needs a
    parallel_mode with it (implied as ``(axis, 2) x data rest`` when there is none)."""
    return mesh_dim_implication(
        axis, f"it needs the {axis.name!r} dimension of parallel_mode's device mesh to {axis.verb}"
    )


def _lacks(axis: Axis) -> Callable[[Any, Any], bool]:
    def lacks(_mine, pm) -> bool:
        return not any(n == axis.name for n, _ in pm.groups)

    lacks.__doc__ = f"parallel_mode has no {axis.name!r} dimension"
    return lacks


def axis_dimension(axis: Axis) -> Conflict:
    """A parallel_mode without the axis's dimension leaves its owner nothing to work over."""
    return Conflict(
        "parallel_mode",
        f"parallel_mode has no {axis.name!r} dimension to {axis.verb}",
        f"add ({axis.name!r}, n) to parallel_mode's groups, e.g. parallel_mode([({axis.name!r}, 2), ('data', 1)])",
        when=_lacks(axis),
    )


def axis_rules(axis: Axis) -> tuple[tuple[Requirement, ...], tuple[Implication, ...], tuple[Conflict, ...]]:
    """``(requires, implies, conflicts)`` every owner of ``axis`` gets (see :class:`Contract`)."""
    return (axis_world_size(axis),), (axis_mesh_dim(axis),), (axis_dimension(axis),)


def _adding(declared: tuple, derived: tuple) -> tuple:
    """``declared`` and the derived rules it does not hold yet (a contract replaced keeps one copy)."""
    keep = [r for r in derived if not any(_same_rule(r, d) for d in declared)]
    return (*keep, *declared)


def _same_rule(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, Conflict):  # the derived ``when`` is a fresh closure: compare what it says
        return (a.other, a.reason, a.fix) == (b.other, b.reason, b.fix)
    return a == b


@dataclass(frozen=True)
class Contract:
    stage: Stage
    requires: tuple[Requirement, ...] = ()
    conflicts: tuple[Conflict, ...] = ()
    orders: tuple[Order, ...] = ()
    owns: tuple[str, ...] = ()
    implies: tuple[Implication, ...] = ()
    #: Short tags saying what the transform does; other contracts may name them in rules.
    roles: tuple[str, ...] = ()
    #: Other transforms (by name) this one reads from the plan at apply time: ``ctx.find(name)``
    #: raises for any name not listed here, and explain() shows them.
    reads: tuple[str, ...] = ()
    #: True when the step changes parameter names on purpose (a wrapper that prefixes them...);
    #: otherwise the plan checks, after the step, that every parameter name is kept.
    renames: bool = False
    #: Roles this transform fills by default in some environments (see :class:`DefaultOwner`).
    defaults: tuple[DefaultOwner, ...] = ()
    #: How the step changes per-rank memory, for the estimate (see :class:`Cost`).
    cost: Cost = Cost()
    #: The mesh axis this transform owns: its requirement, implication and missing-dimension conflict
    #: are derived (:func:`axis_rules`), and a dimension of it > 1 counts as used.
    axis: Axis | None = None
    #: Other mesh axes the transform works over without owning them (a dimension > 1 of them counts as used).
    uses: tuple[Axis, ...] = ()

    def __post_init__(self):
        if self.axis is None:
            return
        requires, implies, conflicts = axis_rules(self.axis)
        object.__setattr__(self, "requires", _adding(self.requires, requires))
        object.__setattr__(self, "implies", _adding(self.implies, implies))
        object.__setattr__(self, "conflicts", _adding(self.conflicts, conflicts))

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Every mesh axis the transform works over: its own, then the ones it uses."""
        return (*((self.axis,) if self.axis is not None else ()), *self.uses)

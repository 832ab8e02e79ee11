"""The Transform base class, the training state it maps, and the registry.

A transform is a frozen dataclass (its config) with a class-level :class:`~.contract.Contract`.
``apply(state, ctx)`` maps a :class:`TrainState` — the user's ``(model, optim, loader)`` plus the
process groups and optimizer hooks that travel with it — to a new one. Transforms read no global
state and leave none behind; what one step tells a later one travels in the state or is read
from the plan (``ctx.find("amp")``), and only for names the reader's contract declares in
``reads``.

The registry maps names to classes. Registering a name that is taken is a ConfigError unless the
class asks for it (``class MyAmp(Transform, replace=True)``); tests scope their registrations
with :func:`registry_scope`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from composable_atorch.core.contract import Contract
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, UnknownTransformError

if TYPE_CHECKING:
    import torch

    from composable_atorch.runtime.optim import OptimizerHook


@dataclass
class TrainState:
    """What flows through a plan: the triple, plus what travels with it.

    ``optim`` is the user's (inner) optimizer — the plan wraps it with the collected ``hooks`` at
    the end. ``parallel`` holds process groups / device meshes made by parallel transforms.
    ``param_names`` maps ``id(param)`` of every parameter the user's optimizer held to its
    canonical name, so any step that replaces parameters can have the optimizer rebuilt by name.
    """

    model: torch.nn.Module
    optim: Any = None
    loader: Any = None
    parallel: Any = None
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
    def transforms(self) -> tuple[Transform, ...]: ...


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
    reader: Transform | None = None

    def for_step(self, transform: Transform) -> ApplyContext:
        return dataclasses.replace(self, reader=transform)

    def find(self, name: str) -> Transform | None:
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


_REGISTRY: dict[str, type[Transform]] = {}
_ALIASES: dict[str, str] = {}
#: ATorch names whose transforms are not built (yet): name -> why.
_PLANNED: dict[str, str] = {}


@dataclass(frozen=True)
class Transform:
    """Base class. Subclasses are frozen dataclasses that set ``name`` and ``contract``."""

    name: ClassVar[str] = ""
    contract: ClassVar[Contract]
    #: Other names users may know this transform by (ATorch's ``amp_native``...).
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, replace: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            _register(cls, replace)

    # -- what subclasses implement ---------------------------------------------------------
    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        raise NotImplementedError

    def describe(self) -> str:
        """One line for explain(): what this step does with this config."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({args})"

    def resolve(self, env: Environment) -> tuple[Transform | None, str | None]:
        """Adapt to the environment before ordering: (transform to use, note) or (None, why skipped).

        The default keeps the transform as it is. fp8's ``backend="auto"`` picks a backend here.
        """
        return self, None

    def adjust_seed_list(self, transforms: tuple[Transform, ...]) -> tuple[Transform, ...]:
        """ATorch's list form only: the strategy's transforms, adjusted for a key of this entry that
        belongs to another step in this library (sequence_parallel's ``sp_size`` is parallel_mode's
        tensor size). The default changes nothing; compose() checks the result as any other plan."""
        return transforms

    @classmethod
    def candidates(cls, search: SearchContext) -> tuple[Transform, ...]:
        """Configurations the auto search may try for this kind of transform.

        Empty (the default) means auto mode never proposes it. The search space is the product
        over registered kinds of ``(absent, *candidates)``, filtered by compose() — so a new
        transform joins the search by declaring candidates here, not by editing a list elsewhere.
        """
        return ()

    @classmethod
    def from_seed(cls, config: Any = None) -> Transform:
        """Build from ATorch's ``(name, config)`` form. ``None`` means ATorch's default config.

        The default accepts a dict of fields; transforms whose ATorch config has another shape
        (a tuple of classes, a dtype string) override this.
        """
        if config is None:
            return cls()
        if isinstance(config, dict):
            return build(cls.name, config)
        return cls(config)

    # -- config as data ---------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def sort_key(self) -> tuple:
        return (int(self.contract.stage), self.name, repr(sorted(self.config().items(), key=lambda kv: kv[0])))

    # -- composition ------------------------------------------------------------------------
    def __or__(self, other):
        return composer()(self, other)

    def __ror__(self, other):
        return composer()(other, self)

    def __call__(self, model, optim=None, loader=None):
        """A single transform applies like a one-step plan."""
        return composer()(self)(model, optim, loader)


def _same_class(a: type, b: type) -> bool:
    """The same class defined again (a module reloaded), not a different one under a taken name."""
    return a.__module__ == b.__module__ and a.__qualname__ == b.__qualname__


def _register(cls: type[Transform], replace: bool) -> None:
    taken = _REGISTRY.get(cls.name)
    if taken is not None and not replace and not _same_class(taken, cls):
        raise ConfigError(
            f"transform name of {cls.__module__}.{cls.__qualname__}",
            cls.name,
            f"a name not taken (it is {taken.__module__}.{taken.__qualname__}); "
            f"to replace it on purpose: class {cls.__name__}(..., replace=True)",
        )
    for alias in cls.aliases:
        owner = _ALIASES.get(alias) or (alias if alias in _REGISTRY else None)
        if owner is not None and owner != cls.name and not replace:
            raise ConfigError(
                f"alias of transform {cls.name!r}", alias, f"an alias not taken (it names {owner!r}), or replace=True"
            )
    _REGISTRY[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name


@contextlib.contextmanager
def registry_scope() -> Iterator[None]:
    """Registrations made inside are undone on exit (and any replaced built-in restored).

    ``with registry_scope(): class Toy(Transform): name = "toy" ...`` — for tests and experiments.
    """
    saved = (dict(_REGISTRY), dict(_ALIASES), dict(_PLANNED))
    try:
        yield
    finally:
        for table, old in zip((_REGISTRY, _ALIASES, _PLANNED), saved, strict=True):
            table.clear()
            table.update(old)


def registry() -> dict[str, type[Transform]]:
    """Registered transforms by canonical name (importing the package registers all built ones)."""
    return dict(_REGISTRY)


def register_planned(name: str, why: str) -> None:
    """Record a seed name whose transform is not built yet, so lookups say so instead of 'unknown'."""
    _PLANNED[name] = why


def lookup(name: str) -> type[Transform]:
    """The transform class for a canonical name or alias; UnknownTransformError otherwise."""
    canonical = _ALIASES.get(name, name)
    if canonical in _REGISTRY:
        return _REGISTRY[canonical]
    known = set(_REGISTRY) | set(_ALIASES)
    if name in _PLANNED and name not in known:
        raise UnknownTransformError(name, known, note=f"not built yet ({_PLANNED[name]})")
    raise UnknownTransformError(name, known)


def build(name: str, config: dict[str, Any] | None = None) -> Transform:
    """A transform from its registry name (or alias) and a config dict; ConfigError on bad fields."""
    cls = lookup(name)
    config = dict(config or {})
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ConfigError(f"{cls.name} config field {unknown[0]!r}", config[unknown[0]], f"one of {sorted(fields)}")
    return cls(**config)


# compose() sits above this module (core.compose imports it, and core.plan), so the ``|`` operator
# of transforms and plans cannot import it without a cycle: compose registers itself here when it is
# imported, which importing the package always does. The dependency points one way, down.
_COMPOSER: list[Callable[..., Any]] = []


def set_composer(compose: Callable[..., Any]) -> None:
    """Called once by :mod:`composable_atorch.core.compose` at import."""
    _COMPOSER[:] = [compose]


def composer() -> Callable[..., Any]:
    """The registered :func:`~composable_atorch.core.compose.compose`."""
    if not _COMPOSER:
        raise ConfigError(
            "compose", "not registered", "import composable_atorch (it registers compose) before composing with |"
        )
    return _COMPOSER[0]

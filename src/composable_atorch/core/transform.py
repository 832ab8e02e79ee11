"""The Transform base class: a frozen dataclass (its config) with a class-level contract.

A transform's :class:`~.contract.Contract` says, as data, where it goes and what it needs.
``apply(state, ctx)`` maps a :class:`~.context.TrainState` — the user's ``(model, optim, loader)``
plus the process groups and optimizer hooks that travel with it — to a new one. Transforms read no
global state and leave none behind; what one step tells a later one travels in the state or is
read from the plan (``ctx.find("amp")``), and only for names the reader's contract declares in
``reads``.

The base class sits above :func:`~.compose.compose` (``a | b`` composes directly) and the plan;
the registry (:mod:`.registry`) and the state a step maps (:mod:`.context`) sit below all of them.
Their names are re-exported here, where transform authors look for them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from composable_atorch.core.compose import compose
from composable_atorch.core.context import ApplyContext, PlanView, SearchContext, TrainState
from composable_atorch.core.contract import Contract
from composable_atorch.core.registry import (
    _PLANNED,
    build,
    lookup,
    register,
    register_planned,
    registry,
    registry_scope,
)
from composable_atorch.environment import Environment

__all__ = [
    "_PLANNED",
    "ApplyContext",
    "PlanView",
    "SearchContext",
    "TrainState",
    "Transform",
    "build",
    "lookup",
    "register_planned",
    "registry",
    "registry_scope",
]


@dataclass(frozen=True)
class Transform:
    """Base class. Subclasses are frozen dataclasses that set ``name`` and ``contract``."""

    name: ClassVar[str] = ""
    contract: ClassVar[Contract]
    #: Other names users may know this transform by (ATorch's ``amp_native``...).
    aliases: ClassVar[tuple[str, ...]] = ()
    #: True for a transform that stands for several (see :meth:`expand`).
    expands: ClassVar[bool] = False

    def __init_subclass__(cls, replace: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            register(cls, replace)

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

    def expand(self, env: Environment, others: tuple[Transform, ...]) -> tuple[Transform, ...] | None:
        """The transforms this one stands for (a class that sets ``expands = True``), or None (the default)
        when it is a step of its own.

        compose() replaces a transform that expands by its parts before anything else is checked,
        after checking its own declared conflicts and owned roles against ``others`` (the rest of
        the request), so each part is then checked and ordered by its own contract; explain() says
        what it expanded into. The plan's JSON keeps the transform as asked for.
        """
        return None

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
        return compose(self, other)

    def __ror__(self, other):
        return compose(other, self)

    def __call__(self, model, optim=None, loader=None):
        """A single transform applies like a one-step plan."""
        return compose(self)(model, optim, loader)

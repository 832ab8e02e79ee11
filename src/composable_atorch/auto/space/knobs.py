"""How the registered kinds form the search's knobs: a kind, or contending kinds sharing one knob
(:func:`dimensions`: the data-parallel engine), and the ``parallel_mode`` knob the axes' layout
options form (:class:`Degrees`: context, Ulysses and expert degrees, hybrid sharding's zero groups,
each offered by its transform's ``candidates()`` from the model's facts).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.core.context import LayoutOption, NotOffered
from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import _PLANNED, Transform, lookup
from composable_atorch.errors import UnknownTransformError
from composable_atorch.runtime.layout import BATCH_DIMS

ABSENT = "absent"
#: the knob the axes' layout options form (named after the step every option lays out)
KNOB = "parallel_mode"


def canonical_kind(name: str) -> str | None:
    """The registry name for a name or alias; None for a seed name that is planned but not built."""
    try:
        return lookup(name).name
    except UnknownTransformError:
        if name in _PLANNED:
            return None
        raise


def _contenders(a: type[Transform], b: type[Transform]) -> bool:
    """Two kinds contend when they own a common role or either declares a conflict with the other."""
    ca, cb = a.contract, b.contract
    if set(ca.owns) & set(cb.owns):
        return True
    tags_a, tags_b = {a.name, *ca.owns, *ca.roles}, {b.name, *cb.owns, *cb.roles}
    return any(c.other in tags_b for c in ca.conflicts) or any(c.other in tags_a for c in cb.conflicts)


def dimensions(kinds: dict[str, type[Transform]]) -> list[tuple[str, ...]]:
    """Kinds grouped into knobs: contending kinds (see :func:`_contenders`) share one knob.

    ddp, zero1, zero2 and fsdp own gradient sync / optimizer-state sharding, so they form one knob,
    "the data-parallel engine", whose options are their valid sub-combinations. Read from the
    contracts: a new engine joins the knob by declaring what it owns.
    """
    parent = {k: k for k in kinds}

    def root(k):
        while parent[k] != k:
            k = parent[k]
        return k

    for a, b in itertools.combinations(sorted(kinds), 2):
        if _contenders(kinds[a], kinds[b]):
            parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for k in sorted(kinds):
        groups.setdefault(root(k), []).append(k)
    return [tuple(g) for g in groups.values()]


@dataclass
class Degrees:
    """The ``parallel_mode`` knob the axes' layout options form: ``options`` label -> its transforms (the
    layout, then the step); ``pinned`` when an included kind is among them (no "absent" option);
    ``notes`` why a degree was not proposed; ``rules`` the options' ``admit`` rules."""

    options: dict[str, tuple[Transform, ...]] = field(default_factory=dict)
    pinned: bool = False
    notes: list[str] = field(default_factory=list)
    rules: tuple[Callable[[Plan], str | None], ...] = ()

    @classmethod
    def of(cls, answers: list[tuple[str, Any]], forced: set[str], pinned_knob: bool, notes=()) -> Degrees:
        """The knob from each kind's layout answers (``(kind, LayoutOption | NotOffered)`` in registry order).

        Options are listed by what they divide: sequence dimensions, then batch dimensions with a step of
        their own, then layouts alone, each by degree (a fixed order: the sampler's categorical
        parameter stays the same, and a stored study resumes). With ``forced`` kinds (included, offering
        nothing but layouts) every option holds one of them. ``notes`` come first (what the model's facts
        could not tell); a reason several kinds give in their own name is said once, the kinds joined by " / "."""
        offered = list({a: None for _, a in answers if isinstance(a, LayoutOption)})
        offered.sort(key=lambda o: (o.dim in BATCH_DIMS, not o.steps, o.degree))
        if forced:
            offered = [o for o in offered if any(t.name in forced for t in o.steps)]
        said: dict[tuple[str, str], list[str]] = {}
        for kind, a in answers:
            if isinstance(a, NotOffered):
                key = (a.reason, "") if a.subject == kind else (a.reason, a.subject)
                if a.subject not in said.setdefault(key, []):
                    said[key].append(a.subject)
        return cls(
            {o.label: o.transforms for o in offered},
            bool(offered) and bool(forced or pinned_knob),
            [*notes, *(f"{' / '.join(subjects)} not proposed: {reason}" for (reason, _), subjects in said.items())],
            tuple(dict.fromkeys(o.admit for o in offered if o.admit is not None)),
        )

    def admit(self, then: Callable[[Plan], str | None] | None = None) -> Callable[[Plan], str | None] | None:
        """The options' rules, then ``then``, as one ``admit(plan) -> reason | None``."""
        rules = (*self.rules, *((then,) if then is not None else ()))
        if not rules:
            return None
        return lambda plan: next((why for rule in rules if (why := rule(plan))), None)

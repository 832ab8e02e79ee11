"""The search space, generated from the registry: for each knob, "absent" or one of its options.

Each registered class offers configs through its ``candidates(SearchContext)`` classmethod; a kind
with no candidates is never proposed. An axis whose degree is a mesh dimension (context, Ulysses,
expert, hybrid sharding's zero groups) answers with :class:`~composable_atorch.core.context.LayoutOption`
s, read from the model and its first batch (:class:`~composable_atorch.core.context.ModelFacts`):
together they form one more knob, ``parallel_mode`` (:class:`~.knobs.Degrees`). A point of the space
is an *assignment* ``{knob: label}``; compose() is the constraint that turns it into a Plan or rejects
it (conflict, unmet requirement) before it costs a dry run. Two assignments whose composed plans have
the same steps are the same plan, measured once (``plan_key``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from composable_atorch.auto.space.knobs import ABSENT, KNOB, Degrees, canonical_kind, dimensions
from composable_atorch.auto.space.plans import label_of, plan_key, plan_needs_criterion, planning_admit
from composable_atorch.auto.workload import block_classes, example_model, facts_notes, model_facts
from composable_atorch.core.compose import compose
from composable_atorch.core.context import LayoutOption, NotOffered
from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import SearchContext, Transform, registry
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError, ConfigError

if TYPE_CHECKING:
    from composable_atorch.auto.policy import SpaceOptions
    from composable_atorch.auto.workload import Workload


@dataclass(frozen=True)
class Point:
    """One assignment of the space and what compose() made of it."""

    assignment: tuple[tuple[str, str], ...]
    plan: Plan | None
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.plan is not None

    @property
    def key(self) -> str | None:
        return None if self.plan is None else plan_key(self.plan)


@dataclass
class Enumeration:
    """Every assignment of a space, composed: the distinct valid plans and the rejected ones."""

    valid: dict[str, Point] = field(default_factory=dict)  # plan key -> first assignment giving it
    invalid: list[Point] = field(default_factory=list)
    duplicates: int = 0  # valid assignments whose plan another assignment already gave

    @property
    def total(self) -> int:
        return len(self.valid) + len(self.invalid) + self.duplicates

    def near(self, anchor: dict[str, str] | None, seen, rng) -> dict[str, str]:
        """An untried plan's assignment one knob (or the fewest knobs) away from ``anchor``: any untried
        plan without an anchor, any valid plan once every one was tried (measured or ruled out)."""
        left = [point for key, point in self.valid.items() if key not in seen]
        if not left:
            return dict(rng.choice(list(self.valid.values())).assignment)
        if anchor is None:
            return dict(rng.choice(left).assignment)

        def distance(point) -> int:
            return sum(anchor.get(knob) != label for knob, label in point.assignment)

        nearest = min(distance(p) for p in left)
        return dict(rng.choice([p for p in left if distance(p) == nearest]).assignment)


class SearchSpace:
    """``{knob: {label: transforms}}`` built from the registry, with compose() as the constraint.

    A knob is one kind, or a group of contending kinds (:func:`dimensions`) whose options are the
    sub-combinations compose() accepts on their own (the others are counted in ``rejected``).
    ``excluded`` drops kinds from the search; ``included`` pins kinds to be present (one of their
    candidates); ``extra`` adds given configs as options of their kind (e.g. a loaded strategy
    to fine-tune from); ``customize(plan) -> plan`` adjusts every composed plan (settings that are
    not searched, such as ``find_unused_parameters``); ``admit(plan) -> reason | None`` rejects
    composed plans the workload cannot train (a pipeline without a criterion), like compose() does,
    after the rules of the ``parallel_mode`` knob's options (:class:`Degrees`: the axes' degrees, read
    from ``search.model``). ``notes`` join the knob's (what the model's facts could not tell).
    """

    def __init__(
        self,
        search: SearchContext,
        *,
        excluded: Iterable[str] = (),
        included: Iterable[str] = (),
        extra: Iterable[Transform] = (),
        customize: Callable[[Plan], Plan] | None = None,
        admit: Callable[[Plan], str | None] | None = None,
        notes: Iterable[str] = (),
    ):
        self.customize = customize
        self.env = search.env
        excluded_kinds = {k for k in (canonical_kind(n) for n in excluded) if k is not None}
        included_kinds = set()
        for name in included:
            kind = canonical_kind(name)
            if kind is None:
                raise ConfigError("included", name, "transforms that are built (this one is planned, not built)")
            if kind in excluded_kinds:
                raise ConfigError("included", name, "a transform that is not also in excluded")
            included_kinds.add(kind)
        if KNOB in excluded_kinds:  # no layout knob: no model facts, no axis reads the model for its degrees
            search = dataclasses.replace(search, model=None)
        self.search = search = dataclasses.replace(search, included=frozenset(included_kinds))
        per_kind, classes, answers, forced = self._ask(search, excluded_kinds, included_kinds, extra)
        if KNOB in excluded_kinds:
            answers = []
        known = [*notes, *facts_notes(search.model)]
        self.degrees = Degrees.of(answers, forced, KNOB in included_kinds, known)
        by_degrees = {t.name for combo in self.degrees.options.values() for t in combo}
        for kind in sorted(included_kinds - set(per_kind) - by_degrees):
            why = "; ".join(self.degrees.notes)
            raise ConfigError(
                "included",
                kind,
                f"transforms that offer search candidates here ({kind} offers none for {self.env.describe()}"
                f"{': ' + why if why else ''}); pass it in load_strategy instead",
            )
        self.admit = self.degrees.admit(admit)
        #: sub-combinations of a knob that compose() rejected while the space was built
        self.rejected: list[tuple[str, str]] = []
        self.options: dict[str, dict[str, tuple[Transform, ...]]] = {}
        for group in dimensions(classes):
            self.options["+".join(group)] = self._knob(group, per_kind)
        if self.degrees.options:
            absent = {} if self.degrees.pinned else {ABSENT: ()}
            self.options[KNOB] = {**absent, **self.degrees.options}

    @staticmethod
    def _ask(search, excluded: set[str], included: set[str], extra) -> tuple:
        """Each kind's candidates: ``(options per kind, their classes, layout answers, forced kinds)``.
        A forced kind is an included one that offers nothing but layouts (its degrees)."""
        per_kind: dict[str, list[Transform | None]] = {}
        classes, answers, forced = {}, [], set()
        for kind, cls in sorted(registry().items()):
            if kind in excluded:
                continue
            found = list(cls.candidates(search))
            layouts = [(kind, c) for c in found if isinstance(c, LayoutOption | NotOffered)]
            answers += layouts
            found = [c for c in found if isinstance(c, Transform)]
            found += [t for t in extra if t.name == kind and t not in found]
            if not found:
                if layouts and kind in included:
                    forced.add(kind)
                continue
            per_kind[kind] = ([] if kind in included else [None]) + list(dict.fromkeys(found))
            classes[kind] = cls
        return per_kind, classes, answers, forced

    def _knob(self, group: tuple[str, ...], per_kind: dict) -> dict[str, tuple[Transform, ...]]:
        if len(group) == 1:
            return {ABSENT if t is None else label_of(t): (() if t is None else (t,)) for t in per_kind[group[0]]}
        combos = [
            tuple(t for t in combo if t is not None) for combo in itertools.product(*(per_kind[k] for k in group))
        ]
        by_key: dict[str, tuple[Transform, ...]] = {}
        for combo in sorted(combos, key=len, reverse=True):  # the explicit spelling wins over an implied one
            label = " + ".join(label_of(t) for t in combo) or ABSENT
            try:
                key = plan_key(compose(*combo, env=self.env))
            except CompositionError as exc:
                self.rejected.append((label, f"{type(exc).__name__}: {exc}"))
                continue
            by_key.setdefault(key, combo)
        ordered = sorted(by_key.values(), key=len)
        return {(" + ".join(label_of(t) for t in combo) or ABSENT): combo for combo in ordered}

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        *,
        world_size: int,
        batch_size: int,
        env: Environment | None = None,
        **kwargs,
    ) -> SearchSpace:
        """The space for ``model`` at ``world_size`` (other environment facts detected here)."""
        env = (env or Environment.detect()).with_(world_size=world_size)
        return cls(SearchContext(env=env, block_classes=block_classes(model), batch_size=batch_size), **kwargs)

    # -- the space --------------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        """The knob names (a kind, or contending kinds joined by '+')."""
        return tuple(self.options)

    @property
    def size(self) -> int:
        n = 1
        for choices in self.options.values():
            n *= len(choices)
        return n

    def assignments(self) -> Iterator[dict[str, str]]:
        for labels in itertools.product(*(list(c) for c in self.options.values())):
            yield dict(zip(self.kinds, labels))

    def transforms(self, assignment: dict[str, str]) -> list[Transform]:
        out: list[Transform] = []
        for knob, label in assignment.items():
            if knob not in self.options or label not in self.options[knob]:
                raise ConfigError(f"search assignment {knob!r}", label, f"one of {list(self.options.get(knob, {}))}")
            out.extend(self.options[knob][label])
        return out

    def point(self, assignment: dict[str, str]) -> Point:
        """Compose an assignment. An invalid one comes back with compose()'s error as the reason."""
        items = tuple(sorted(assignment.items()))
        try:
            plan = compose(*self.transforms(assignment), env=self.env)
            if self.customize is not None:
                plan = self.customize(plan)
        except CompositionError as exc:
            return Point(items, None, f"{type(exc).__name__}: {exc}")
        refused = self.admit(plan) if self.admit is not None else None
        return Point(items, None, refused) if refused else Point(items, plan)

    def nothing(self) -> Point:
        """Asking for nothing: what compose() makes of no request here (at world > 1 it implies data
        parallelism), customized and admitted as every point is. Its assignment is empty: it is the
        reference the space is measured against, not one of its assignments (see :meth:`baseline`)."""
        return self.point({})

    def baseline(self, enumeration: Enumeration | None = None) -> Point | None:
        """The first assignment whose plan is :meth:`nothing`'s: what the search measures first, the
        reference every other plan is against. None when asking nothing is refused or no assignment
        of the space gives that plan. ``enumeration`` (this space's :meth:`enumerate`) saves composing
        the assignments again."""
        nothing = self.nothing()
        if not nothing.valid:
            return None
        if enumeration is not None:
            return enumeration.valid.get(nothing.key)
        return next((p for a in self.assignments() if (p := self.point(a)).valid and p.key == nothing.key), None)

    def point_of(self, plan: Plan) -> Point | None:
        """The valid point that asks for exactly ``plan``'s requested transforms (a loaded strategy to
        start from), or None when the space has no such assignment or compose() rejects it here."""
        assignment = self.assignment_of(plan)
        if not assignment:
            return None
        point = self.point(assignment)
        return point if point.valid else None

    def assignment_of(self, plan: Plan) -> dict[str, str] | None:
        """The assignment that asks for exactly ``plan``'s requested transforms, if the space has one."""
        wanted = {t.name: t for t in plan.requested}
        out = {}
        for knob, choices in self.options.items():
            kinds = set(knob.split("+")) | {t.name for combo in choices.values() for t in combo}
            mine = {wanted.pop(k) for k in kinds if k in wanted}
            label = next((lab for lab, combo in choices.items() if set(combo) == mine), None)
            if label is None and not mine:
                label = self.implied_label(knob)
            if label is None:
                return None
            out[knob] = label
        return None if wanted else out

    def implied_label(self, knob: str) -> str | None:
        """The option of ``knob`` that stands for asking nothing of it, where the knob has no "absent":
        the one that composes to what compose() implies on its own (at world > 1 data parallelism
        is implied, so "absent" and "ddp" are the same plan, listed once by its explicit name)."""
        if ABSENT in self.options[knob]:
            return ABSENT
        try:
            nothing = plan_key(compose(env=self.env))
        except CompositionError:
            return None
        for label, combo in self.options[knob].items():
            try:
                if plan_key(compose(*combo, env=self.env)) == nothing:
                    return label
            except CompositionError:
                continue
        return None

    def enumerate(self) -> Enumeration:
        """Compose every assignment (cheap: no model is touched) and sort them out."""
        result = Enumeration()
        for assignment in self.assignments():
            p = self.point(assignment)
            if not p.valid:
                result.invalid.append(p)
            elif p.key in result.valid:
                result.duplicates += 1
            else:
                result.valid[p.key] = p
        return result

    def suggest(self, trial) -> dict[str, str]:
        """Ask an optuna trial for one label per knob (categorical parameters named by knob)."""
        return {knob: trial.suggest_categorical(knob, list(choices)) for knob, choices in self.options.items()}

    def describe(self) -> str:
        lines = [f"search space for {self.env.describe()}: {self.size} assignment(s)"]
        for knob, choices in self.options.items():
            lines.append(f"  {knob}: {', '.join(choices)}")
        if self.rejected:
            lines.append(f"  ({len(self.rejected)} sub-combination(s) rejected by compose() while building the knobs)")
        lines.extend(f"  ({note})" for note in self.degrees.notes)
        return "\n".join(lines)


def build_space(workload: Workload, env: Environment, space: SpaceOptions) -> tuple[SearchSpace, Any]:
    """The search's space for ``workload`` at ``env`` and the example model it was read from (built on
    the meta device where it can be): the registry's candidates, the axes' degrees for what the model
    and its first batch show (:func:`~.workload.model_facts`), and the rules that rule plans out before
    any trial (the model-parallel planning checks first). Runs the user's model code: call it under a
    limit (the study does)."""
    example = example_model(workload.model_fn)
    facts, notes = model_facts(example, workload)
    context = SearchContext(env, block_classes(example), workload.batch_size, space.allow_compile, facts)
    built = SearchSpace(
        context,
        excluded=space.excluded,
        included=space.included,
        extra=space.start_from.requested if space.start_from else (),
        customize=space.customize,
        notes=notes,
    )
    needs = None if workload.criterion is not None else plan_needs_criterion
    built.admit = planning_admit(example, built.degrees.admit(needs))
    return built, example

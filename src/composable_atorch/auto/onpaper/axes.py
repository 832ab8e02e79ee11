"""The compose space at a target world, cut into axes the paper search moves along one at a time.

Each axis is a few transform kinds asked for their candidates at the *target* environment
(``SearchContext(env, ..., on_paper=True)``: the cluster's world and nodes, not this machine's), as
the trial search asks them, through a :class:`~composable_atorch.auto.space.SearchSpace` of those
kinds alone: ``engine`` (ddp / zero1 / zero2 / fsdp, hybrid sharding's ``zero x data`` layout),
``precision`` (amp, fp8), ``checkpoint``, ``micro_batches`` (accumulate), ``compile``, ``tensor``,
``context``, ``ulysses``, ``expert``, ``pipeline`` (mixed_parallel's degrees, micro-batches and
schedules) and any other registered kind that offers candidates. An option is the axis's transforms
(``()`` for "absent"); a point of the space is one option per axis, composed by compose(), which
rejects what does not go together. The space is the product of the axes: it is counted, never
listed (a 64-device world has millions of points).

The blocks fsdp wraps, checkpoint and compile act on are the model's outermost repeated block (the
transformer layer: where torchtitan and ATorch's examples apply them); their sub-blocks are not
offered on paper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composable_atorch.auto.space import ABSENT, KNOB, SearchSpace, canonical_kind, plan_needs_criterion, planning_admit
from composable_atorch.auto.workload import block_classes, example_model, facts_notes, model_facts
from composable_atorch.core.compose import compose
from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import SearchContext, Transform, registry
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError

if TYPE_CHECKING:
    from composable_atorch.auto.policy import SpaceOptions
    from composable_atorch.auto.workload import Workload

#: axis name -> the kinds it asks (in the order the search walks them; a kind not named here that offers
#: candidates becomes an axis of its own, after these)
AXES: dict[str, tuple[str, ...]] = {
    "checkpoint": ("checkpoint",),
    "micro_batches": ("accumulate",),
    "compile": ("compile",),
    "engine": ("ddp", "zero1", "zero2", "fsdp"),
    "precision": ("amp", "fp8"),
    "tensor": ("tensor_parallel",),
    "context": ("context_parallel",),
    "ulysses": ("sequence_parallel",),
    "expert": ("expert_parallel",),
    "pipeline": ("mixed_parallel",),
    "module_replace": ("module_replace",),
}


@dataclass(frozen=True)
class Option:
    """One option of an axis: its label, its transforms, and the degree it lays out (1 without one)."""

    label: str
    transforms: tuple[Transform, ...]
    degree: int = 1
    key: str = ""  # the plan the option composes to alone (its identity)

    @property
    def absent(self) -> bool:
        return not self.transforms


@dataclass
class Axis:
    """One axis: its options (the first is "absent" unless a kind of it is pinned by ``included``)."""

    name: str
    options: dict[str, Option]
    #: the option that is what compose() does when the axis asks nothing ("absent", or ddp at world > 1)
    implied: str | None = None

    def find(self, test: Callable[[Option], bool]) -> str | None:
        return next((label for label, o in self.options.items() if test(o)), None)

    def fallbacks(self, label: str | None) -> list[str]:
        """What to try instead of ``label`` when it does not compose with another axis's move: the same
        option without its layout (an engine without hybrid sharding's ``zero x data``), then the implied one."""
        out = []
        if label in self.options:
            bare = tuple(t for t in self.options[label].transforms if t.name != KNOB)
            out += [lab for lab, o in self.options.items() if o.transforms == bare and lab != label][:1]
        if self.implied is not None and self.implied != label and self.implied not in out:
            out.append(self.implied)
        return out


@dataclass
class Space:
    """The axes at the target environment, the rules every composed plan passes, and what was not offered."""

    env: Environment
    axes: dict[str, Axis]
    admit: Callable[[Plan], str | None]
    notes: list[str] = field(default_factory=list)
    rejected: int = 0  # axis sub-combinations compose() refused while the axes were built
    example: Any = None

    @property
    def size(self) -> int:
        """Points of the space: the product of the axes' option counts."""
        n = 1
        for axis in self.axes.values():
            n *= len(axis.options)
        return n

    def point(self, assignment: dict[str, str]) -> tuple[Plan | None, str | None]:
        """Compose one option per axis: the plan, or why compose() or a rule refuses it."""
        transforms = [t for name, label in assignment.items() for t in self.axes[name].options[label].transforms]
        try:
            plan = compose(*transforms, env=self.env)
        except CompositionError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        why = self.admit(plan)
        return (None, why) if why else (plan, None)

    def describe(self) -> str:
        lines = [f"{self.size:,} points over {len(self.axes)} axes at {self.env.describe()}"]
        lines += [f"  {a.name}: {len(a.options)} ({', '.join(list(a.options)[:4])}{', ...' * (len(a.options) > 4)})"
                  for a in self.axes.values()]
        return "\n".join(lines)


def build(workload: Workload, env: Environment, space: SpaceOptions) -> Space:
    """The axes for ``workload`` at ``env``: each axis a SearchSpace of its kinds alone, asked on paper."""
    example = example_model(workload.model_fn)
    facts, notes = model_facts(example, workload)
    blocks = block_classes(example)[:1]
    excluded = {k for k in (canonical_kind(n) for n in space.excluded) if k is not None}
    context = SearchContext(env, blocks, workload.batch_size, "compile" not in excluded, facts, on_paper=True)
    kinds = {k for k, cls in registry().items() if k not in excluded}
    groups = {name: tuple(k for k in members if k in kinds) for name, members in AXES.items()}
    named = {k for members in AXES.values() for k in members}
    groups.update({k: (k,) for k in sorted(kinds - named)})
    axes, rules, rejected = {}, [], 0
    for name, members in groups.items():
        if not members:
            continue
        sub = SearchSpace(
            context,
            excluded=sorted(set(registry()) - set(members) - {KNOB}),  # the layout knob: the axis's degrees
            included=[k for k in space.included if canonical_kind(k) in members],
        )
        notes += [n for n in sub.degrees.notes if n not in notes]
        rejected += len(sub.rejected)
        if sub.admit is not None:
            rules.append(sub.admit)
        options = _options(sub)
        if len(options) > 1 or (options and not next(iter(options.values())).absent):
            nothing = sub.nothing()
            implied = next((lab for lab, o in options.items() if nothing.valid and o.key == nothing.key), None)
            axes[name] = Axis(name, options, implied)
    notes += facts_notes(facts)
    if not blocks:
        notes.append("no repeated block found: fsdp wraps, checkpoint and compile have nothing to act on")
    needs = None if workload.criterion is not None else plan_needs_criterion
    then = _all(rules + ([needs] if needs else [])) or _admit_all
    admit = planning_admit(example, then)
    return Space(env, axes, admit, notes, rejected, example)


def _admit_all(plan: Plan) -> None:
    return None


def _all(rules: list[Callable[[Plan], str | None]]) -> Callable[[Plan], str | None] | None:
    if not rules:
        return None
    return lambda plan: next((why for rule in rules if (why := rule(plan))), None)


def _options(sub: SearchSpace) -> dict[str, Option]:
    """The axis's options: every assignment of its knobs, one per distinct plan (composed alone here; the
    layout knob's options carry their degree)."""
    out: dict[str, Option] = {}
    seen: set[str] = set()
    for assignment in sub.assignments():
        point = sub.point(assignment)
        if not point.valid or point.key in seen:
            continue
        seen.add(point.key)
        parts = tuple(t for knob, label in assignment.items() for t in sub.options[knob][label])
        label = " + ".join(dict.fromkeys(w for w in map(short, parts) if w)) or ABSENT
        out[label] = Option(label, parts, degree_of(parts), point.key)
    return dict(sorted(out.items(), key=lambda kv: (not kv[1].absent, kv[1].degree)))


def degree_of(parts) -> int:
    """The model-parallel degree an option lays out: its layout's largest non-data dimension, or its pipeline."""
    degree = 1
    for t in parts:
        if t.name == "parallel_mode":
            for dim, n in t.groups:
                if dim not in ("data", "zero"):
                    degree = max(degree, int(n))
        if t.name == "mixed_parallel":
            degree = max(degree, int(t.pipeline or 1))
    return degree


def short(t: Transform) -> str:
    """A few words for one transform of a plan, for the ranking table (describe() says it in full)."""
    name = t.name
    if name == "parallel_mode":
        names = {"zero": "hybrid shard"}  # fsdp sharded over the zero dimension, replicated over data
        groups = [f"{names.get(dim, dim)} {n}" for dim, n in t.groups if n > 1 and dim != "data"]
        return " x ".join(groups)
    if name in ("tensor_parallel", "context_parallel"):
        return ""  # said by its layout
    if name == "sequence_parallel":
        return "ulysses"
    if name == "fsdp":
        return "fsdp hybrid" if getattr(t, "hybrid", False) else "fsdp"
    if name == "amp":
        return t.dtype
    if name == "fp8":
        return f"fp8 {t.recipe or 'tensorwise'}"
    if name == "checkpoint":
        return f"ckpt {t.policy}"
    if name == "accumulate":
        return f"accum {t.steps}"
    if name == "mixed_parallel":
        tensor = f"tensor {t.tensor} x " if (t.tensor or 1) > 1 else ""
        return f"{tensor}pipeline {t.pipeline} {t.schedule} {t.microbatches} mb"
    if name == "compile":
        return "compile"
    return name


def with_packages(env: Environment) -> tuple[Environment, str | None]:
    """``env`` with this machine's optional packages where it declares none (the cluster runs the same
    software the plan is written with), and the note saying so."""
    if env.packages:
        return env, None
    here = Environment.detect().packages
    note = f"optional packages assumed on the target: those installed here ({', '.join(sorted(here)) or 'none'})"
    return dataclasses.replace(env, packages=here), note


def label_plan(plan: Plan) -> str:
    """The plan's steps in a few words (implied ones too: the ddp a pipeline-less plan syncs with)."""
    words = [w for w in map(short, plan.transforms) if w]
    return " + ".join(words) or ABSENT

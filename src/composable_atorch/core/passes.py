"""compose()'s passes: small pure functions from one draft plan to the next, each with its reason.

As Composer's ``passes.py`` orders algorithms by running a list of passes, :func:`run` is compose():

0. :func:`expand` — a transform that stands for several (mixed_parallel) replaced by its parts;
1. :func:`requirements` — each requested transform resolved against the environment, its
   requirements checked (skipped with a note, or refused);
2. :func:`default_owners` and 3. :func:`implications`, grown to a fixpoint by :func:`grow` — the
   steps the plan needs that nobody asked for;
4. :func:`conflicts` — the refusals the contracts declare, and roles owned twice;
5. :func:`unused_axes` — a note for a mesh dimension > 1 that no step works over;
6. :func:`order` — the stable topological sort into steps, each with the reasons for its place.

Everything decided here comes from the contracts (:mod:`.contract`): the stage order, pairwise
orders, conflicts, exclusive roles, requirements and implications. Ties in the order are broken by
(stage, name, config), so the result does not depend on the order the user wrote: ``a | b == b | a``.

This module sits below the plan and the Transform base class (it reads transforms through their
contracts and the registry only), so ``|`` and ``Plan.from_dict`` reach it without a cycle.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from composable_atorch.core.contract import STAGE_REASONS, Contract
from composable_atorch.core.registry import lookup, registry
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, ConflictError, RequirementError
from composable_atorch.runtime.axes import BY_NAME

#: one step of the plan as the order pass gives it: (transform, reasons for its place, implied by)
StepData = tuple[Any, tuple[str, ...], str | None]


@dataclass(frozen=True)
class Draft:
    """A plan being composed: the active transforms, explain()'s notes, and who implied which step."""

    env: Environment
    strict: bool = False
    active: tuple[Any, ...] = ()
    notes: tuple[str, ...] = ()
    implied_by: tuple[tuple[str, str], ...] = ()

    def tags(self) -> set[str]:
        """Every name, owned role and role of the active transforms."""
        return set().union(*(_tags(t) for t in self.active)) if self.active else set()

    def adding(self, transform, by: str, notes: Iterable[str]) -> Draft:
        return dataclasses.replace(
            self,
            active=(*self.active, transform),
            notes=(*self.notes, *notes),
            implied_by=(*self.implied_by, (transform.name, by)),
        )


def _tags(t) -> set[str]:
    return {t.name, *t.contract.owns, *t.contract.roles}


def _is_transform(item) -> bool:
    """A transform is what declares a Contract on its class (read structurally: the base class sits above)."""
    return isinstance(getattr(type(item), "contract", None), Contract)


# -- the request ------------------------------------------------------------------------------


def flatten(items) -> list:
    """Transforms, plans (their requested transforms) and lists of them, as one list of transforms."""
    out: list = []
    for item in items:
        if _is_transform(item):
            out.append(item)
        elif isinstance(getattr(item, "requested", None), tuple):  # a Plan: what it was asked for
            out.extend(item.requested)
        elif isinstance(item, list | tuple):
            out.extend(flatten(item))
        else:
            raise ConfigError(
                "compose() argument", item, "transforms or plans, e.g. compose(amp('bf16'), checkpoint(Block))"
            )
    return out


def unique(transforms: list) -> tuple:
    """Drop exact duplicates (asking twice is asking once); two of one kind with different configs
    conflict, since a plan holds one step per kind. Sorted, so the request has no order."""
    by_name: dict[str, Any] = {}
    for t in transforms:
        seen = by_name.get(t.name)
        if seen is None:
            by_name[t.name] = t
        elif seen != t:
            raise ConflictError(
                seen.describe(),
                t.describe(),
                "two transforms of the same kind with different configs",
                f"keep one {t.name}(...)",
            )
    return tuple(sorted(by_name.values(), key=lambda t: t.sort_key()))


def admit(t, env: Environment, strict: bool) -> tuple[Any, tuple[str, ...]]:
    """``(t resolved against env, notes)``, or ``(None, notes)`` when it is skipped.

    A transform adapts to the environment first (fp8's ``backend="auto"`` picks one), then its
    requirements are checked: an unmet one skips it with a note where the contract allows
    (``on_unmet="skip"``) and the plan is not strict, and is a RequirementError otherwise.
    """
    resolved, note = t.resolve(env)
    if resolved is None:
        if strict:
            raise RequirementError(t.name, note or "an environment that can run it", "drop it, or run where it can")
        return None, (f"skipped {t.name}: {note}",)
    notes = (f"{t.name}: {note}",) if note else ()
    for req in resolved.contract.requires:
        missing = req.unmet(env, resolved)
        if missing is None:
            continue
        if req.on_unmet == "skip" and not strict:
            return None, (*notes, f"skipped {t.name}: needs {missing} ({req.fix()})")
        raise RequirementError(t.name, missing, req.fix())
    return resolved, notes


# -- the passes -------------------------------------------------------------------------------


def _refused(a, b) -> None:
    """ConflictError when ``a`` declares a conflict with ``b`` (or with one of its tags), or both own a role."""
    for c in a.contract.conflicts:
        if c.other in _tags(b) and (c.when is None or c.when(a, b)):
            raise ConflictError(a.describe(), b.describe(), c.reason, c.fix)
    shared = set(a.contract.owns) & set(b.contract.owns)
    if shared:
        role = sorted(shared)[0]
        raise ConflictError(
            a.describe(),
            b.describe(),
            f"both own {role!r} and only one transform may",
            f"keep either {a.name} or {b.name}",
        )


def expand(draft: Draft, requested: tuple) -> tuple[Draft, tuple]:
    """``(draft with notes, the request with every expanding transform replaced by its parts)``.

    A transform that is several (mixed_parallel: parallel_mode | tensor_parallel | pipeline_parallel
    ...) says so in ``expand()``; its own conflicts and owned roles are checked against the rest of the
    request first (what it stood for is refused as it was), then each part is checked and ordered
    by its own contract like any requested step. Parts it did not take from the request are shown as
    implied by it.
    """
    out, notes, implied = [], list(draft.notes), list(draft.implied_by)
    for t in requested:
        if not getattr(t, "expands", False):
            out.append(t)
            continue
        others = tuple(o for o in requested if o is not t)
        for o in others:
            _refused(t, o)
            _refused(o, t)
        parts = t.expand(draft.env, others)
        out.extend(parts)
        implied.extend((p.name, t.name) for p in parts if all(p is not o for o in others))
        notes.append(f"{t.describe()} = {' | '.join(p.describe() for p in parts)}")
    if len(out) == len(requested) and all(a is b for a, b in zip(out, requested, strict=True)):
        return draft, requested
    return dataclasses.replace(draft, notes=tuple(notes), implied_by=tuple(implied)), unique(out)


def requirements(draft: Draft, requested: Iterable) -> Draft:
    """Admit every requested transform (:func:`admit`): what the environment cannot run never
    reaches the order, and the reason is in the notes."""
    active, notes = [], list(draft.notes)
    for t in requested:
        resolved, said = admit(t, draft.env, draft.strict)
        notes.extend(said)
        if resolved is not None:
            active.append(resolved)
    return dataclasses.replace(draft, active=tuple(active), notes=tuple(notes))


def _defaults(env: Environment):
    """(transform class, DefaultOwner rule) for every registered default whose environment condition holds."""
    for cls in sorted(registry().values(), key=lambda c: c.name):
        for rule in cls.contract.defaults:
            if rule.when.unmet(env, None) is None:
                yield cls, rule


def default_owners(draft: Draft) -> Draft:
    """Add the first registered default owner of a role nothing in the draft owns (or the draft as it is).

    Some roles must be owned where the environment says so: at world size >= 2 a plan that
    synchronizes no gradients is not a distributed training plan (ranks would drift apart), so
    the role's default owner (ddp) is added, with its reason. Strict plans raise instead.
    """
    present = draft.tags()
    for owner, rule in _defaults(draft.env):
        if rule.role in present:
            continue
        if draft.strict:
            raise RequirementError(
                "plan",
                f"an owner of {rule.role!r} ({rule.reason})",
                f"add {owner.name}(...) or another owner of {rule.role!r} yourself",
            )
        new, said = admit(owner(), draft.env, draft.strict)
        if new is None:
            raise RequirementError(
                "plan",
                f"an owner of {rule.role!r} ({rule.reason}), and the default {owner.name} cannot run here",
                said[-1],
            )
        why = f"the environment ({rule.when.describe()})"
        return draft.adding(new, why, (*said, f"implied {new.describe()} by {why}: {rule.reason}"))
    return draft


def implications(draft: Draft) -> Draft:
    """Add the first step an active transform implies and the draft lacks (or the draft as it is).

    A transform that needs another (ddp needs parallel_mode's process groups) says so in its
    contract; the implied step is admitted and adapted to the environment like a requested one.
    ``satisfied_by`` names or roles make it moot. Strict plans raise instead.
    """
    present = draft.tags()
    for t in draft.active:
        for imp in t.contract.implies:
            if imp.name in present or present & set(imp.satisfied_by):
                continue
            if draft.strict:
                raise RequirementError(
                    t.name, f"{imp.name} in the plan ({imp.reason})", f"add {imp.name}(...) yourself"
                )
            new, said = admit(lookup(imp.name)(**imp.config), draft.env, draft.strict)
            if new is None:
                raise RequirementError(
                    t.name, f"{imp.name} ({imp.reason}), which this environment cannot run", said[-1]
                )
            return draft.adding(new, t.name, (*said, f"implied {new.describe()} by {t.name}: {imp.reason}"))
    return draft


def grow(draft: Draft, passes: tuple[Callable[[Draft], Draft], ...] = (default_owners, implications)) -> Draft:
    """Run the growing passes until none adds a step, starting over after each addition.

    An added step may imply another, or own a role so that no default is needed: defaults are
    settled first, one step at a time, so the result does not depend on the order of the request.
    """
    while True:
        for grow_pass in passes:
            grown = grow_pass(draft)
            if grown is not draft:
                draft = grown
                break
        else:
            return draft


def conflicts(draft: Draft) -> Draft:
    """The draft as it is, or ConflictError: a declared conflict (with its reason and fix) between
    two active transforms, or a role two of them own (only one transform may own a role)."""
    for a, b in itertools.permutations(draft.active, 2):
        for c in a.contract.conflicts:
            if c.other in _tags(b) and (c.when is None or c.when(a, b)):
                raise ConflictError(a.describe(), b.describe(), c.reason, c.fix)
    for a, b in itertools.combinations(draft.active, 2):
        _refused(a, b)
    return draft


def _mesh_groups(active) -> tuple[tuple[str, int], ...]:
    """The (name, size) dimensions of the active parallel_mode (after its refit to the world), or ()."""
    pm = next((t for t in active if t.name == "parallel_mode"), None)
    groups = getattr(pm, "groups", ())
    return tuple(groups) if isinstance(groups, tuple) else ()


def axis_users(active) -> dict[str, list[str]]:
    """Mesh dimension -> the active steps whose contracts own or use it (``Contract.axis`` / ``uses``)."""
    users: dict[str, list[str]] = {}
    for t in active:
        for axis in t.contract.axes:
            users.setdefault(axis.name, []).append(t.name)
    return users


def _unbatched(active) -> list[tuple[str, int]]:
    """parallel_mode's dimensions > 1 over which ranks read the same samples (declared axes, not batch ones)."""
    return [(n, s) for n, s in _mesh_groups(active) if s > 1 and n in BY_NAME and not BY_NAME[n].batch]


def unused_axes(draft: Draft) -> Draft:
    """The draft with a note for each dimension > 1 of parallel_mode that no step works over.

    Its ranks read the same samples: replicas, unless the user's own model works over the group
    (ATorch's ``parallel_group("model")`` serves hand-written Megatron layers from a plan of
    ``parallel_mode`` alone). So it is said in explain(), not refused: refusing would break plans
    that train today. Batch dimensions (data, zero, expert) always have a user: the loader splits
    the batch over them and the gradient-sync owner averages over them.
    """
    users = axis_users(draft.active)
    notes = []
    for name, size in _unbatched(draft.active):
        if users.get(name):
            continue
        owners = sorted(n for n, cls in registry().items() if BY_NAME[name] in cls.contract.axes)
        notes.append(
            f"parallel_mode's {name!r} dimension of {size} has no step that works over it "
            f"({', '.join(f'{o}()' for o in owners)}): its ranks read the same samples, which is right only when "
            f"your own model uses its group (ATorch's parallel_group({name!r})); otherwise add one or drop it"
        )
    return dataclasses.replace(draft, notes=(*draft.notes, *notes)) if notes else draft


def axes_note(active) -> str | None:
    """explain()'s line for the model-parallel dimensions > 1 and the steps that use each (None without)."""
    users = axis_users(active)
    dims = _unbatched(active)
    if not dims:
        return None
    said = [
        f"{n} {s} by {', '.join(users[n])}" if users.get(n) else f"{n} {s} by no step (see the notes)" for n, s in dims
    ]
    return "model-parallel dimensions: " + "; ".join(said)


def _sorted(transforms: list) -> tuple[list, dict[str, list[str]]]:
    """Stable topological sort: stages first, then each contract's pairwise Order rules."""
    index = {t.name: t for t in transforms}
    edges: dict[str, set[str]] = {t.name: set() for t in transforms}
    why: dict[str, list[str]] = {t.name: [] for t in transforms}
    for a, b in itertools.permutations(transforms, 2):
        if a.contract.stage < b.contract.stage:
            edges[a.name].add(b.name)
    for t in transforms:
        for rule in t.contract.orders:
            for other in (o for o in transforms if o is not t and rule.other in _tags(o)):
                first, second = (other, t) if rule.after else (t, other)
                edges[first.name].add(second.name)
                where = "after" if rule.after else "before"
                why[t.name].append(f"{where} {other.name}: {rule.reason}")
    indegree = {n: 0 for n in edges}
    for n in edges:
        for m in edges[n]:
            indegree[m] += 1
    ready = [(index[n].sort_key(), n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    ordered: list = []
    while ready:
        _, n = heapq.heappop(ready)
        ordered.append(index[n])
        for m in edges[n]:
            indegree[m] -= 1
            if indegree[m] == 0:
                heapq.heappush(ready, (index[m].sort_key(), m))
    if len(ordered) != len(transforms):
        stuck = sorted(n for n, d in indegree.items() if d > 0)
        raise ConflictError(
            stuck[0], stuck[-1], "their ordering rules contradict each other (a cycle)", "drop one of them"
        )
    return ordered, why


def order(draft: Draft) -> tuple[StepData, ...]:
    """The steps in order, each with the reasons for its place (its stage, then the pairwise rules
    that placed it) and what implied it: explain() prints them, so every position is justified."""
    ordered, why = _sorted(sorted(draft.active, key=lambda t: t.sort_key()))
    implied_by = dict(draft.implied_by)
    steps = []
    for t in ordered:
        stage = t.contract.stage
        reason = f"stage {int(stage)} ({stage.name.lower().replace('_', ' ')}): {STAGE_REASONS[stage]}"
        steps.append((t, (reason, *why[t.name]), implied_by.get(t.name)))
    return tuple(steps)


def run(items, *, strict: bool, env: Environment) -> tuple[tuple, tuple[StepData, ...], tuple[str, ...]]:
    """compose()'s pipeline: ``(requested, steps, notes)`` for ``items`` in ``env``."""
    requested = unique(flatten(items))
    draft, parts = expand(Draft(env, strict), requested)
    draft = unused_axes(conflicts(grow(requirements(draft, parts))))
    return requested, order(draft), draft.notes

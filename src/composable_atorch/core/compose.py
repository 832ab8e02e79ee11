"""compose(): check transforms against their contracts and the environment, order them, return a Plan.

Everything compose() decides comes from the contracts (see :mod:`.contract`): the stage order,
pairwise orders, conflicts, exclusive roles, requirements and implications. The order is a stable
topological sort with ties broken by (stage, name, config), so it does not depend on the order the
user wrote: ``a | b == b | a``.
"""

from __future__ import annotations

import heapq
import itertools

from composable_atorch.core.contract import STAGE_REASONS
from composable_atorch.core.plan import Plan, Step
from composable_atorch.core.transform import Transform, lookup, registry, set_composer
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, ConflictError, RequirementError


def _flatten(items) -> list[Transform]:

    out: list[Transform] = []
    for item in items:
        if isinstance(item, Plan):
            out.extend(item.requested)
        elif isinstance(item, Transform):
            out.append(item)
        elif isinstance(item, list | tuple):
            out.extend(_flatten(item))
        else:
            raise ConfigError(
                "compose() argument", item, "transforms or plans, e.g. compose(amp('bf16'), checkpoint(Block))"
            )
    return out


def _unique(transforms: list[Transform]) -> list[Transform]:
    """Drop exact duplicates; two of one kind with different configs conflict."""
    by_name: dict[str, Transform] = {}
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
    return sorted(by_name.values(), key=Transform.sort_key)


def _tags(t: Transform) -> set[str]:
    return {t.name, *t.contract.owns, *t.contract.roles}


def _check_conflicts(transforms: list[Transform]) -> None:
    for a, b in itertools.permutations(transforms, 2):
        for c in a.contract.conflicts:
            if c.other in _tags(b) and (c.when is None or c.when(a, b)):
                raise ConflictError(a.describe(), b.describe(), c.reason, c.fix)
    for a, b in itertools.combinations(transforms, 2):
        shared = set(a.contract.owns) & set(b.contract.owns)
        if shared:
            role = sorted(shared)[0]
            raise ConflictError(
                a.describe(),
                b.describe(),
                f"both own {role!r} and only one transform may",
                f"keep either {a.name} or {b.name}",
            )


def _order(transforms: list[Transform]) -> tuple[list[Transform], dict[str, list[str]]]:
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
    ordered: list[Transform] = []
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


def _admit(t: Transform, env: Environment, strict: bool, notes: list[str]) -> Transform | None:
    """``t`` resolved against ``env`` with its requirements checked; None (and a note) if skipped."""
    resolved, note = t.resolve(env)
    if resolved is None:
        if strict:
            raise RequirementError(t.name, note or "an environment that can run it", "drop it, or run where it can")
        notes.append(f"skipped {t.name}: {note}")
        return None
    if note:
        notes.append(f"{t.name}: {note}")
    for req in resolved.contract.requires:
        missing = req.unmet(env, resolved)
        if missing is None:
            continue
        if req.on_unmet == "skip" and not strict:
            notes.append(f"skipped {t.name}: needs {missing} ({req.fix()})")
            return None
        raise RequirementError(t.name, missing, req.fix())
    return resolved


def _default_owners(env: Environment):
    """(transform class, DefaultOwner rule) for every registered default whose environment condition holds."""
    for cls in sorted(registry().values(), key=lambda c: c.name):
        for rule in cls.contract.defaults:
            if rule.when.unmet(env, None) is None:
                yield cls, rule


def compose(*items, strict: bool = False, env: Environment | None = None):
    """Check and order transforms (or plans) into a :class:`~composable_atorch.core.plan.Plan`.

    ``env`` defaults to :meth:`Environment.detect`. With ``strict=True`` anything compose()
    would otherwise do on its own — add an implied step, skip a step the environment cannot run —
    raises RequirementError instead.
    """

    env = Environment.detect() if env is None else env
    requested = _unique(_flatten(items))
    notes: list[str] = []

    # 1. requirements and environment-dependent resolution
    active = [t for t in (_admit(t, env, strict, notes) for t in requested) if t is not None]

    # 2. implications and environment defaults, to a fixpoint
    implied_by: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        present = set().union(*(_tags(t) for t in active)) if active else set()
        for owner, rule in _default_owners(env):
            if rule.role in present:
                continue
            if strict:
                raise RequirementError(
                    "plan",
                    f"an owner of {rule.role!r} ({rule.reason})",
                    f"add {owner.name}(...) or another owner of {rule.role!r} yourself",
                )
            new = _admit(owner(), env, strict, notes)
            if new is None:
                raise RequirementError(
                    "plan",
                    f"an owner of {rule.role!r} ({rule.reason}), and the default {owner.name} cannot run here",
                    notes[-1],
                )
            active.append(new)
            implied_by[new.name] = f"the environment ({rule.when.describe()})"
            notes.append(f"implied {new.describe()} by the environment ({rule.when.describe()}): {rule.reason}")
            changed = True
            break
        if changed:
            continue
        for t in list(active):
            for imp in t.contract.implies:
                if imp.name in present or present & set(imp.satisfied_by):
                    continue
                if strict:
                    raise RequirementError(
                        t.name, f"{imp.name} in the plan ({imp.reason})", f"add {imp.name}(...) yourself"
                    )
                # an implied step is checked and adapted to the environment like a requested one
                new = _admit(lookup(imp.name)(**imp.config), env, strict, notes)
                if new is None:
                    raise RequirementError(
                        t.name, f"{imp.name} ({imp.reason}), which this environment cannot run", notes[-1]
                    )
                active.append(new)
                implied_by[new.name] = t.name
                notes.append(f"implied {new.describe()} by {t.name}: {imp.reason}")
                changed = True
                break
            if changed:
                break

    # 3. conflicts and 4. order
    _check_conflicts(active)
    ordered, why = _order(sorted(active, key=Transform.sort_key))
    steps = []
    for t in ordered:
        stage = t.contract.stage
        reason = f"stage {int(stage)} ({stage.name.lower().replace('_', ' ')}): {STAGE_REASONS[stage]}"
        steps.append(Step(t, tuple([reason, *why[t.name]]), implied_by.get(t.name)))
    return Plan(steps=tuple(steps), requested=tuple(requested), notes=tuple(notes), env=env, strict=strict)


set_composer(compose)

"""compose(): check transforms against their contracts and the environment, order them, return a Plan.

compose() runs named passes (:mod:`.passes`), each a small pure function with its reason: the
expansion of a transform that stands for several (mixed_parallel), requirements, then default
owners and implications to a fixpoint, then conflicts, the note on unused mesh dimensions, then the
order. An axis owner's shared rules come from its contract's ``axis`` (:mod:`.contract`).
Everything they decide comes from the contracts (see :mod:`.contract`): the stage order, pairwise
orders, conflicts, exclusive roles, requirements and implications. The order is a stable
topological sort with ties broken by (stage, name, config), so it does not depend on the order the
user wrote: ``a | b == b | a``.

``a | b`` is ``compose(a, b)``: the Transform base class sits above this module and calls it; a
plan composes through :meth:`Plan.composed <composable_atorch.core.plan.Plan.composed>`, which
this function returns.
"""

from __future__ import annotations

from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment


def compose(*items, strict: bool = False, env: Environment | None = None) -> Plan:
    """Check and order transforms (or plans) into a :class:`~composable_atorch.core.plan.Plan`.

    ``env`` defaults to :meth:`Environment.detect`. With ``strict=True`` anything compose()
    would otherwise do on its own — add an implied step, skip a step the environment cannot run —
    raises RequirementError instead.
    """
    return Plan.composed(items, strict=strict, env=env)

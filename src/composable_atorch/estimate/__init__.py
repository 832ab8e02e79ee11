"""Predict before running: each rank's memory (and step time where torch can) of a plan.

    from composable_atorch.estimate import estimate
    est = estimate(plan, model, batch, world_size=64, device="cuda")
    est.ranks[0].peak, est.peak, est.fits("80GiB"), print(est.table())

The name: ``composable_atorch.estimate`` is this subpackage, and the subpackage is itself callable
(``composable_atorch.estimate(plan, model, batch, world_size=...)`` calls :func:`estimate`), so the
issue's spelling works without a top-level function shadowing the subpackage (which would break
``import composable_atorch.estimate`` and attribute access to its modules). ``estimate_plan`` is
the same function under a name that cannot be confused with the package.

Nothing real is allocated: the model's shapes run on FakeTensorMode over torch's fake process
group, measured by the same MemTracker the trial worker uses (see :mod:`.simulate`).
"""

from __future__ import annotations

import sys
import types

from composable_atorch.estimate.core import estimate
from composable_atorch.estimate.inputs import EstimateError, parse_bytes
from composable_atorch.estimate.result import Estimate, RankCost

estimate_plan = estimate

__all__ = ["Estimate", "EstimateError", "RankCost", "estimate", "estimate_plan", "parse_bytes"]


class _CallableModule(types.ModuleType):
    """This package's module type: calling the package calls :func:`estimate`."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

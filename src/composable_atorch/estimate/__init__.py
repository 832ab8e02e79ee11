"""Predict before running: each rank's memory and the step time of a plan.

    from composable_atorch.estimate import estimate
    est = estimate(plan, model, batch, world_size=64, device="cuda")
    est.ranks[0].peak, est.peak, est.fits("80GiB"), print(est.table())

``composable_atorch.estimate`` is this package and ``composable_atorch.estimate.estimate`` the
function; ``composable_atorch.estimate_plan`` is the same function at the top level, under a name
that cannot be confused with the package.

Nothing real is allocated: the model's shapes run on FakeTensorMode over torch's fake process
group, measured by the same MemTracker the trial worker uses (see :mod:`.simulate`). The step time
is that simulated step's ops priced with this machine's calibration (:mod:`.steptime`,
:mod:`.calibrate`; ``est.step_time`` splits it into compute / comm / overhead), or torch's
RuntimeEstimator on a CUDA device. A deep model's identical blocks are simulated at a few depths
and extrapolated (:mod:`.dedup`).
"""

from __future__ import annotations

from composable_atorch.estimate.core import estimate
from composable_atorch.estimate.inputs import EstimateError
from composable_atorch.estimate.result import Estimate, RankCost
from composable_atorch.units import parse_bytes  # the one byte-size parser, re-exported for estimate users

estimate_plan = estimate

__all__ = ["Estimate", "EstimateError", "RankCost", "estimate", "estimate_plan", "parse_bytes"]

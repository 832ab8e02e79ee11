"""A plan's step time on hardware this machine does not have: the simulated step priced on paper.

The estimate simulates each distinct rank's real engines on fake tensors (``estimate/simulate.py``);
here that step's ordered ops (:mod:`.trace`) are priced with a :class:`~composable_atorch.hardware.Hardware`
(:mod:`.ops` for kernels, :mod:`.comm` for collectives), laid on a compute and a communication
stream with the overlap a GPU has (:mod:`.timeline`: FSDP's prefetched all-gathers and gradient
reduce-scatters under compute, DDP's buckets under the backward, tensor-parallel collectives
exposed), compile's fusion applied as a stated rule (:mod:`.fusion`), and a pipeline's bubble added
per schedule (:mod:`.schedules`). :mod:`.utilization` turns the step into tokens/s, TFLOP/s, MFU
and HFU per device.
"""

from __future__ import annotations

from composable_atorch.estimate.paper.price import RankStep, Setting, Step, price_run, setting_for, step
from composable_atorch.estimate.paper.trace import Event, OrderedTrace
from composable_atorch.estimate.paper.utilization import Utilization, utilization

__all__ = [
    "Event",
    "OrderedTrace",
    "RankStep",
    "Setting",
    "Step",
    "Utilization",
    "price_run",
    "setting_for",
    "step",
    "utilization",
]

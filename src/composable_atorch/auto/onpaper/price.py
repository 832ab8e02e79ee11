"""One plan priced on paper: :func:`composable_atorch.estimate.estimate` at the target environment, kept
as the few figures the search ranks and prints (:class:`Priced`), each plan once.

The estimate runs the plan's real steps on fake tensors (nothing is allocated) and prices the simulated
step on the target's :class:`~composable_atorch.hardware.Hardware`; the model is rebuilt on the meta
device for every plan (a plan changes the model it is given), the batch is the workload's first global
batch. An estimate is interrupted at the search's deadline (``auto.preflight.time_limit``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.auto.preflight import PredictionTimeout, time_limit
from composable_atorch.auto.space import pipeline_degree, plan_key
from composable_atorch.auto.workload import Workload, first_batch
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment

#: what a priced plan is: fits the device, over its memory, or the estimate could not price it
FITS, OVER, FAILED = "fits", "over memory", "estimate failed"


@dataclass
class Priced:
    """What the estimate said of one plan (per device; the largest rank's peak), or why it said nothing."""

    key: str
    plan: Plan
    assignment: dict[str, str]
    status: str
    step_time_s: float | None = None
    tokens_per_s_per_device: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    peak_bytes: int | None = None
    micro_batch: int | None = None
    micro_batches: int | None = None
    seconds: float = 0.0  # the estimate's own time
    reason: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.status == FITS

    @property
    def speed(self) -> float:
        """Tokens/s per device where it fits, else -1 (never the best)."""
        return self.tokens_per_s_per_device or 0.0 if self.fits else -1.0


class Pricer:
    """Prices plans of one workload at one environment, each plan once (by :func:`plan_key`).

    ``limit``: device bytes a plan's peak (times ``1 + margin``) must stay within; ``deadline``:
    ``time.monotonic()`` after which no estimate runs and the running one is cut. ``estimator`` is
    :func:`~composable_atorch.estimate.estimate` or a stand-in with its interface (tests)."""

    def __init__(
        self,
        workload: Workload,
        env: Environment,
        limit: int,
        margin: float,
        deadline: float | None,
        estimator: Callable[..., Any] | None = None,
    ):
        if estimator is None:
            from composable_atorch.estimate import estimate as estimator
        self.workload, self.env, self.limit, self.margin = workload, env, limit, margin
        self.deadline, self.estimator = deadline, estimator
        self.cache: dict[str, Priced] = {}
        self.batch = first_batch(workload)
        self.spent = 0.0
        self.durations: list[float] = []  # seconds of each estimate that priced its plan

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def __call__(self, plan: Plan, assignment: dict[str, str]) -> Priced | None:
        """The plan priced (from the cache when it was), or None when the deadline came first."""
        key = plan_key(plan)
        if key in self.cache:
            return self.cache[key]
        left = self.left()
        if left is not None and left <= min(self.durations, default=0.0):  # it would be cut before it ends
            return None
        start = time.monotonic()
        try:
            with time_limit(left or 0), _quiet():
                est = self._estimate(plan)
        except PredictionTimeout:
            return None
        except Exception as exc:  # noqa: BLE001 - the plan is reported with the estimate's reason
            priced = Priced(key, plan, dict(assignment), FAILED, reason=f"{type(exc).__name__}: {exc}"[:300])
        else:
            priced = self._priced(key, plan, assignment, est)
        priced.seconds = time.monotonic() - start
        self.spent += priced.seconds
        if priced.status != FAILED:
            self.durations.append(priced.seconds)
        self.cache[key] = priced
        return priced

    def _estimate(self, plan: Plan):
        w = self.workload
        return self.estimator(
            plan,
            w.model_fn,
            self.batch,
            world_size=self.env.world_size,
            device="cuda",
            loss_fn=None if pipeline_degree(plan) > 1 and w.criterion is not None else w.loss_fn,
            optimizer=w.optim_fn,
            criterion=w.criterion,
            hardware=self.env.hardware,
            nodes=self.env.nodes,
        )

    def _priced(self, key: str, plan: Plan, assignment: dict[str, str], est) -> Priced:
        peak = int(est.peak)
        fits = peak * (1.0 + self.margin) <= self.limit
        step = est.step_time_s
        return Priced(
            key,
            plan,
            dict(assignment),
            (FITS if fits else OVER) if step is not None else FAILED,
            step,
            est.tokens_per_s_per_device,
            est.tflops_per_device,
            est.mfu,
            est.hfu,
            peak,
            est.micro_batch,
            est.micro_batches,
            reason=None if step is not None else "no step time on paper",
            extra={"split": _split(est)},
        )


def _split(est) -> dict[str, float]:
    """compute / exposed comm / bubble / overhead seconds of the step, where the estimate gives them."""
    timing = getattr(est, "step_time", None)
    if timing is None:
        return {}
    return {k: float(getattr(timing, k)) for k in ("compute", "comm", "bubble", "overhead") if hasattr(timing, k)}


@contextlib.contextmanager
def _quiet():
    """FSDP2's "returned a view tensor" warning is about the user's training, not the simulation (see
    ``auto.predict``); silenced while a plan is simulated here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        yield

"""One plan priced on paper: :func:`composable_atorch.estimate.estimate` at the target environment, kept
as the few figures the search ranks and prints (:class:`Priced`), each plan once.

The estimate runs the plan's real steps on fake tensors (nothing is allocated) and prices the simulated
step on the target's :class:`~composable_atorch.hardware.Hardware`; the model is rebuilt on the meta
device for every plan (a plan changes the model it is given), the batch is the workload's first global
batch. An estimate is interrupted at the search's deadline (``auto.preflight.time_limit``).
"""

from __future__ import annotations

import contextlib
import os
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
#: address space an estimate may add to the process (Linux): the simulation runs on fake tensors, so a
#: real allocation of a model's size (a planner's zero-weight probe of a 7B model: 27 GB) is a bug
#: that should fail that plan's estimate, not take the machine's memory
HEADROOM_BYTES = 8 * 2**30
#: seconds past the deadline after which a running estimate is taken for a hang and interrupted
HANG_S = 60.0


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
    ``time.monotonic()`` after which no estimate starts; ``whole``: how much longer a plan the estimate
    simulates whole (:func:`_whole`) takes than one it extrapolates from a few blocks. ``estimator`` is
    :func:`~composable_atorch.estimate.estimate` or a stand-in with its interface (tests)."""

    def __init__(
        self,
        workload: Workload,
        env: Environment,
        limit: int,
        margin: float,
        deadline: float | None,
        estimator: Callable[..., Any] | None = None,
        whole: float = 1.0,
    ):
        if estimator is None:
            from composable_atorch.estimate import estimate as estimator
        self.workload, self.env, self.limit, self.margin = workload, env, limit, margin
        self.deadline, self.estimator = deadline, estimator
        self.cache: dict[str, Priced] = {}
        self.batch = first_batch(workload)
        self.spent = 0.0
        self.whole = whole  # cost of a whole-model simulation over an extrapolated one
        self.per_micro: list[float] = []  # seconds per simulated micro-batch of each estimate that priced

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def __call__(self, plan: Plan, assignment: dict[str, str]) -> Priced | None:
        """The plan priced (from the cache when it was), or None when the deadline came first."""
        key = plan_key(plan)
        if key in self.cache:
            return self.cache[key]
        left = self.left()
        expected = max(self.per_micro, default=0.0) * _micro_batches(plan) * (self.whole if _whole(plan) else 1.0)
        if left is not None and left <= expected:
            return None  # it would not end before the deadline
        start = time.monotonic()
        try:
            with time_limit(0 if left is None else left + HANG_S), _quiet(), _memory_guard():
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
            self.per_micro.append(priced.seconds / max(1, priced.micro_batches or 1))
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


def _whole(plan: Plan) -> bool:
    """The estimate simulates every block of this plan (DDP's gradient buckets span blocks; a pipeline's
    stages are the model cut), not a few blocks extrapolated."""
    return "ddp" in plan.names or pipeline_degree(plan) > 1


def _micro_batches(plan: Plan) -> int:
    """The micro-batches one step of ``plan`` runs (each is simulated): accumulate's or the pipeline's."""
    steps = [getattr(t, "steps", None) or getattr(t, "microbatches", None) for t in plan.transforms
             if t.name in ("accumulate", "mixed_parallel")]
    return max([1, *(int(s) for s in steps if s)])


def _split(est) -> dict[str, float]:
    """compute / exposed comm / bubble / overhead seconds of the step, where the estimate gives them."""
    timing = getattr(est, "step_time", None)
    if timing is None:
        return {}
    return {k: float(getattr(timing, k)) for k in ("compute", "comm", "bubble", "overhead") if hasattr(timing, k)}


@contextlib.contextmanager
def _memory_guard():
    """The process's address space capped at its current size plus HEADROOM_BYTES while one estimate
    runs (an allocation past it raises, and the plan is reported with that reason); nothing elsewhere."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    cap = size + HEADROOM_BYTES
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def _quiet():
    """FSDP2's "returned a view tensor" warning is about the user's training, not the simulation (see
    ``auto.predict``); silenced while a plan is simulated here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        yield

"""Predictions before any run: a plan's per-rank peak memory and step time, from ``estimate``.

The search asks for a prediction of every valid plan of its space once, before the study: a plan
predicted over the memory budget is not run (it is recorded as infeasible with the prediction, at
no trial cost), and the plans predicted fastest among those that fit are measured first (a prior
for the sampler). Nothing here allocates a real tensor: the model is built on the meta device and
:func:`composable_atorch.estimate.estimate` works on fake tensors and the fake process group.

:func:`predict_plan` is the one place that calls the estimator (its interface is
``estimate(plan, model, batch, *, world_size, device) -> est`` with ``est.ranks[i].peak``,
``est.peak`` and ``est.step_time_s``), so a change there is one edit here. Tests pass a stand-in
estimator with the same interface.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from composable_atorch.auto.preflight import PredictionTimeout, time_limit
from composable_atorch.auto.space import plan_key
from composable_atorch.auto.workload import Workload, first_batch
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment

#: ``estimator(plan, model, batch, *, world_size, device) -> estimate`` (see the module doc)
Estimator = Callable[..., Any]


@dataclass(frozen=True)
class Prediction:
    """What the estimator said of one plan (bytes per rank; seconds per optimizer step), or why it said nothing."""

    peak_bytes: int | None = None  # max over ranks
    peak_bytes_per_rank: tuple[int, ...] = field(default_factory=tuple)
    step_time_s: float | None = None
    #: floating-point operations per step per rank (recomputation included), where counted
    flops: int | None = None
    reason: str | None = None  # why there is no prediction
    #: the plan's compute precision ("fp32", "bf16", "fp16", "fp8"): the model's error differs per dtype
    precision: str = "fp32"
    #: the estimate cannot simulate this plan (a step it leaves out uncounted, or a typed refusal): the
    #: plan is measured instead, never ruled out for having no prediction (:meth:`StepTimeCheck.loses`)
    measure: bool = False

    @property
    def known(self) -> bool:
        return self.peak_bytes is not None

    def over(self, limit: int | None, margin: float) -> bool:
        """Predicted over the budget: ``peak x (1 + margin) > limit``; False when unknown or no limit.

        The margin is the prediction's allowance for error: a plan predicted within it of the limit
        is treated as over (not run), so an under-prediction by less than the margin never costs a
        trial that runs over the budget.
        """
        return limit is not None and self.peak_bytes is not None and self.peak_bytes * (1.0 + margin) > limit

    @property
    def speed_key(self) -> tuple[int, float] | None:
        """How fast the plan is predicted to be, smaller first: the step time where the estimator
        gives one; else the FLOPs per rank (a CPU has no torch runtime estimator: FLOPs tell
        recomputation and model sharding apart, not one communication engine from another)."""
        if self.step_time_s is not None:
            return (0, self.step_time_s)
        return None if self.flops is None else (1, float(self.flops))

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_bytes_per_rank": list(self.peak_bytes_per_rank)}

    @classmethod
    def from_dict(cls, data: dict | None) -> Prediction | None:
        if not data:
            return None
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["peak_bytes_per_rank"] = tuple(fields.get("peak_bytes_per_rank") or ())
        return cls(**fields)


def default_estimator() -> Estimator | None:
    """:func:`composable_atorch.estimate.estimate`, or None where that package is not built yet."""
    try:
        from composable_atorch.estimate import estimate
    except ImportError:
        return None
    return estimate


#: the parallel steps whose simulation is new to the estimate: a typed refusal to estimate a plan
#: holding one (``EstimateError``) means "cannot estimate this yet", not "this plan crashes"
NEW_TO_ESTIMATE = frozenset({"context_parallel", "sequence_parallel", "expert_parallel"})


def unmodelled_steps(plan: Plan) -> list[str]:
    """The plan's steps the estimate leaves out of its simulation without adding their cost back
    (their contract's ``Cost(simulated=False)`` declares nothing, unlike ddp's gradient buckets): a
    prediction of such a plan is not the plan's (a step that splits weights would count them whole)."""
    out = []
    for t in plan.transforms:
        cost = t.contract.cost
        if not cost.simulated and not cost.grad_copies:
            out.append(t.name)
    return out


def cannot_estimate(plan: Plan, exc: BaseException | None) -> str | None:
    """Why ``plan`` is measured rather than predicted, or None: a step the estimate leaves out
    uncounted (:func:`unmodelled_steps`), or a typed refusal to estimate — ``NotImplementedError``, or
    the estimate's ``EstimateError`` on a plan with a step new to it (:data:`NEW_TO_ESTIMATE`)."""
    left_out = unmodelled_steps(plan)
    if left_out:
        return (
            f"not predicted: the estimate leaves {', '.join(left_out)} out of its simulation (its per-rank split "
            "would not be counted); measured instead"
        )
    if exc is None:
        return None
    typed = isinstance(exc, NotImplementedError) or (
        type(exc).__name__ == "EstimateError" and NEW_TO_ESTIMATE & set(plan.names)
    )
    if typed:
        return f"not predicted ({type(exc).__name__}: {exc}"[:260] + "); measured instead"
    return None


def predict_plan(
    estimator: Estimator, plan: Plan, model, batch, *, world_size: int, device: str, **options
) -> Prediction:
    """Call the estimator on one plan and keep what the search uses: peak per rank, step time, FLOPs.
    ``options`` go to the estimator as they are (the workload's ``loss_fn``, ``optimizer`` and
    ``criterion``)."""
    est = estimator(plan, model, batch, world_size=world_size, device=device, **options)
    per_rank = tuple(int(r.peak) for r in est.ranks)
    peak = est.peak if est.peak is not None else max(per_rank, default=None)
    step, flops = getattr(est, "step_time_s", None), getattr(est, "flops", None)
    return Prediction(
        None if peak is None else int(peak),
        per_rank,
        None if step is None else float(step),
        None if flops is None else int(flops),
        precision=compute_precision(plan),
    )


def compute_precision(plan: Plan) -> str:
    """The dtype a plan's matmuls run in: fp8 over amp/half's dtype over fp32."""
    names = set(plan.names)
    if "fp8" in names:
        return "fp8"
    for t in plan.transforms:
        if t.name in ("amp", "half") and getattr(t, "enabled", True):
            return str(getattr(t, "dtype", "bf16"))
    return "fp32"


@contextlib.contextmanager
def _simulation_warnings():
    """Silence, while a plan is simulated here, the one torch warning that is about the user's training,
    not about the simulation: FSDP2's "returned a view tensor". fully_shard warns for every wrapped module
    whose output is a view, which torch's own ``nn.Linear`` returns for a 3-D input (addmm, then a view),
    so nearly every transformer block ending in a projection triggers it. It warns of an in-place op on
    that output dropping FSDP's pre-backward hook; the simulation trains nothing the user could change,
    yet printed from the searching process it landed in the user's log (twice in the README's demo).
    The user's own fsdp training, and a trial's ranks (their logs), still show it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning
        )
        yield


class Predictor:
    """Predicts plans of one workload at one environment, each plan once (by :func:`plan_key`).

    The model is built fresh on the meta device for every plan (a plan may change the model it
    is given); the batch is the first global batch of the workload's dataset, as its loader yields
    it (the plan splits it over the data dimension, as in a trial); the workload's loss, criterion
    (a pipeline plan trains on it) and optimizer go with them. An estimator that raises gives no
    prediction for that plan (the plan then runs, as without predictions), with the reason. ``cache``
    may be shared between searches
    of the same workload (the benchmark replays many).
    """

    #: a prediction runs the user's forward (on fake tensors) in this process: one that takes longer
    #: than this is abandoned (no prediction; the plan is measured in its own processes instead)
    timeout_s: float = 60.0
    #: ``time.monotonic()`` when the search's time budget is spent (the search sets it): a prediction
    #: is cut there, and none starts after it, so predictions never overrun the budget
    deadline: float | None = None
    #: why a prediction was interrupted, once one was: no other is started (each would run the same forward)
    hung: str | None = None

    def __init__(self, estimator: Estimator, workload: Workload, env: Environment, cache: dict | None = None):
        self.estimator, self.workload, self.env = estimator, workload, env
        self.cache: dict[str, Prediction] = {} if cache is None else cache
        self._batch = None

    def batch(self):
        if self._batch is None:
            self._batch = first_batch(self.workload)
        return self._batch

    def model(self):
        import torch

        torch.manual_seed(self.workload.seed)
        with torch.device("meta"):
            return self.workload.model_fn()

    def __call__(self, plan: Plan) -> Prediction:
        key = plan_key(plan)
        if key in self.cache:
            return self.cache[key]
        limit = self.timeout_s
        if self.deadline is not None:
            limit = min(limit, self.deadline - time.monotonic())
            if limit <= 0:  # not cached: a later search with more time predicts it
                return Prediction(reason="the search's time budget is spent")
        if self.hung is not None:  # not cached: a later search may predict it
            return Prediction(reason=f"not predicted: {self.hung} for another plan (each runs the same forward)")
        left_out = cannot_estimate(plan, None)
        if left_out is not None:  # its figure would not be the plan's: not asked for, the plan is measured
            self.cache[key] = Prediction(reason=left_out, precision=compute_precision(plan), measure=True)
        if key not in self.cache:
            try:
                with time_limit(limit), _simulation_warnings():
                    self.cache[key] = predict_plan(
                        self.estimator,
                        plan,
                        self.model(),
                        self.batch(),
                        world_size=self.env.world_size,
                        device=self.env.device,
                        loss_fn=self.workload.loss_fn,
                        optimizer=self.workload.optim_fn,
                        criterion=self.workload.criterion,
                    )
            except PredictionTimeout as exc:
                cut = Prediction(reason=f"the prediction {exc}"[:300])
                if limit < self.timeout_s:  # the search's budget ran out: not cached, a later search may predict it
                    return cut
                # the forward took longer than a trial may: the same forward runs for every plan, so no other
                # prediction is started (each would hang as long)
                self.cache[key], self.hung = cut, cut.reason
            except Exception as exc:  # noqa: BLE001 - no prediction: the plan is measured instead
                why = cannot_estimate(plan, exc)
                self.cache[key] = Prediction(reason=why or f"{type(exc).__name__}: {exc}"[:300], measure=bool(why))
        return self.cache[key]


@dataclass
class StepTimeCheck:
    """Holds the step-time model to what the trials measure, so the search spends no trial on a plan
    predicted to lose.

    The model's seconds are this machine's calibrated kernels, not the trial's (other load, the
    trial's own overheads): each measured plan gives the ratio measured / predicted; their median
    is the model's *scale* and their largest relative departure from it the model's *error*. A plan
    whose prediction, scaled by the lowest ratio (the most favourable to it), is slower than the best
    measured step by more than that error (never less than ``min_error``: two trials do not tell an
    error) cannot be expected to win and is not run. Until ``min_observed`` plans are measured nothing is skipped.

    Ratios are kept per compute precision: the calibration's bf16 kernels can be off by another factor
    than its fp32 ones (on this CPU bf16 was predicted about 2x too fast, fp32 about 1.3x), so trials in
    one dtype say nothing about a plan in another, and such a plan is not skipped on their strength.
    """

    min_error: float = 0.1
    min_observed: int = 2
    ratios: list[float] = field(default_factory=list)
    best_step_s: float | None = None
    #: the ratios by compute precision (``Prediction.precision``)
    by_precision: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, prediction: Prediction | None, result) -> None:
        """A measured trial (a ``TrialResult``) and what was predicted for its plan."""
        step = measured_step_s(result)
        if step is None:
            return
        self.best_step_s = step if self.best_step_s is None else min(self.best_step_s, step)
        if prediction is not None and prediction.step_time_s:
            self.ratios.append(step / prediction.step_time_s)
            self.by_precision.setdefault(prediction.precision, []).append(step / prediction.step_time_s)

    @property
    def scale(self) -> float | None:
        if not self.ratios:
            return None
        ordered = sorted(self.ratios)
        return ordered[len(ordered) // 2]

    @property
    def error(self) -> float:
        scale = self.scale
        measured = max((abs(r / scale - 1.0) for r in self.ratios), default=0.0) if scale else 0.0
        return max(self.min_error, measured)

    def loses(self, prediction: Prediction | None) -> str | None:
        """Why ``prediction``'s plan is not worth a trial, or None (run it)."""
        if prediction is None or len(self.ratios) < self.min_observed:
            return None
        if not prediction.step_time_s:
            # the model ranks the measured plans; one it could not estimate cannot be expected to beat
            # them (a simulated step that fails is how most plans that crash in a trial show up here),
            # unless the estimate said it cannot simulate the plan (then it is measured: the only figure)
            if not prediction.reason or prediction.measure:
                return None
            return f"no step-time prediction ({prediction.reason[:160]}); the model ranks the plans that have one"
        # the most favourable scale the trials of its precision showed: a plan is skipped only when even
        # that says it loses by more than the error (two trials on a busy machine can disagree by 2x)
        same = self.by_precision.get(prediction.precision)
        if not same:
            return None  # no trial in this dtype yet: the model's error for it is unknown
        favourable = min(same)
        expected = prediction.step_time_s * favourable
        if self.best_step_s is None or expected <= self.best_step_s * (1.0 + self.error):
            return None
        return (
            f"predicted {expected:.3f} s per step (model x {favourable:.2f}, the lowest of {len(same)} "
            f"{prediction.precision} trials), "
            f"slower than the best measured {self.best_step_s:.3f} s by more than the model's error "
            f"{self.error:.0%}; not run"
        )

    def loses_unmeasured(self, prediction: Prediction | None, others: list[Prediction]) -> str | None:
        """Before any trial: why ``prediction``'s plan is not worth one, or None. It loses when predicted
        slower than the fastest of ``others`` in its compute precision by more than the model's least error
        (``min_error``): with nothing measured yet, the model's own ranking is all there is, and across
        dtypes it is least to be trusted (see the class docstring)."""
        if prediction is None or not prediction.step_time_s:
            return None
        mine = prediction.step_time_s
        times = [p.step_time_s for p in others if p.step_time_s and p.precision == prediction.precision]
        if not mine or not times or mine <= min(times) * (1.0 + self.min_error):
            return None
        return (
            f"predicted {mine:.3f} s per step, slower than the fastest predicted {min(times):.3f} s by more "
            f"than the model's least error {self.min_error:.0%}; not run"
        )

    def pick_note(self, prediction: Prediction | None, result) -> str:
        """How far the picked plan's measurement is from the model's prediction for it."""
        step = measured_step_s(result)
        if prediction is None or not prediction.step_time_s or step is None:
            return "pick: no step-time prediction to compare"
        scaled = f"; x{self.scale:.2f} scaled {prediction.step_time_s * self.scale:.4f} s" if self.scale else ""
        return (
            f"pick measured {step:.4f} s per step, model predicted {prediction.step_time_s:.4f} s "
            f"({step / prediction.step_time_s - 1.0:+.0%}{scaled}; model error {self.error:.0%})"
        )


def measured_step_s(result) -> float | None:
    """Seconds per optimizer step a trial measured (``TrialResult.step_time``), or None."""
    if result is None or not getattr(result, "ok", False):
        return None
    return getattr(result, "step_time", None) or None


def first_to_measure(predictions: dict[str, Prediction], seen, count: int) -> list[str]:
    """The ``count`` plans (keys) to measure first: the predicted fastest (:attr:`Prediction.speed_key`)
    not measured yet, the fastest of each compute precision first; ties keep the predictions' order
    (a seeded random one). Across dtypes the model errs most (its bf16 kernels were ~2x optimistic
    here, its fp32 ones ~1.3x), so each dtype's best is measured rather than ranked out."""
    ranked = [(p.speed_key, i, k) for i, (k, p) in enumerate(predictions.items()) if p.speed_key and k not in seen]
    ordered = [k for _, _, k in sorted(ranked)]
    fastest_of: dict[str, str] = {}
    for key in ordered:
        fastest_of.setdefault(predictions[key].precision, key)
    chosen = [k for k in ordered if k in fastest_of.values()][:count]
    return chosen + [k for k in ordered if k not in chosen][: count - len(chosen)]


def predictions_note(predictions: dict[str, Prediction], valid: int, ahead_s: float, over: int) -> str:
    """The trials report's line on what was predicted: how many, with a step time, how many ruled out."""
    preds = list(predictions.values())
    known, timed = sum(p.known for p in preds), sum(p.step_time_s is not None for p in preds)
    why = next((p.reason for p in preds if not p.known), None)
    return (
        f"{known} of {valid} valid plans predicted ({timed} with a step time; {ahead_s:.1f} s ahead of the "
        f"study, the rest when proposed); {over} predicted over the budget, not run"
        + (f"; no prediction for some: {why}" if why else "")
    )

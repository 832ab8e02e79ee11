"""What a search records: one record per trial of the study (:class:`TrialRecord`), the search's result
(:class:`SearchResult`), and what the study writes down for each outcome of a proposal (:class:`Recorders`).

Each recorder sets the trial's user attributes (the status and reason the report reads back as a
:class:`TrialRecord`) and tells optuna the outcome: an invalid or skipped plan as pruned (with a
constraint, so the sampler learns to avoid it), a duplicate or failure as failed, a measured plan with
its throughput. They are kept apart from the loop (:mod:`.study`) so that the loop reads as the
sequence of decisions and this module as what each decision writes down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.markup import escape

from composable_atorch.auto.predict import Prediction
from composable_atorch.auto.preflight import PreflightResult
from composable_atorch.auto.space import ABSENT, Enumeration, Point, SearchSpace
from composable_atorch.auto.trial import TrialResult
from composable_atorch.core.plan import Plan


@dataclass
class TrialRecord:
    """One trial of the study as the report shows it."""

    number: int
    status: str  # ok | infeasible | failed | invalid | duplicate | predicted-infeasible (never run)
    assignment: dict[str, str]
    plan_json: str | None = None
    steps: tuple[str, ...] = ()
    result: TrialResult | None = None
    reason: str | None = None
    predicted: Prediction | None = None

    @classmethod
    def from_frozen(cls, trial) -> TrialRecord:
        attrs = trial.user_attrs
        result = TrialResult.from_dict(attrs["result"]) if attrs.get("result") else None
        return cls(
            number=trial.number,
            status=attrs.get("status", trial.state.name.lower()),
            assignment=dict(attrs.get("assignment") or trial.params),
            plan_json=attrs.get("plan_json"),
            steps=tuple(attrs.get("steps", ())),
            result=result,
            reason=attrs.get("reason"),
            predicted=Prediction.from_dict(attrs.get("predicted")),
        )

    @property
    def measured(self) -> bool:
        return self.status in ("ok", "infeasible", "failed")

    @property
    def over_budget(self) -> bool:
        """A run that went over the memory budget: measured over it, or killed out of memory."""
        return self.status == "infeasible" or (self.status == "failed" and "out of memory" in (self.reason or ""))

    @property
    def plan_label(self) -> str:
        chosen = [label for kind, label in sorted(self.assignment.items()) if label != ABSENT]
        return " | ".join(chosen) or "(no transforms)"


@dataclass
class SearchResult:
    study: Any  # optuna.Study
    space: SearchSpace
    enumeration: Enumeration
    records: list[TrialRecord]
    best: TrialRecord | None
    best_plan: Plan | None
    memory_limit: int | None
    wall_time: float
    #: runs this call made / proposals compose() rejected / proposals of plans already measured
    measured_now: int = 0
    invalid_proposals: int = 0
    duplicate_proposals: int = 0
    #: runner calls on plans not among the enumeration's valid plans (an independent check: zero)
    dry_runs_on_invalid: int = 0
    stopped_by: str = ""
    #: the workload's one step with no plan before the study (None: skipped)
    preflight: PreflightResult | None = None
    #: the safety margin on predicted memory; how predictions went (estimator, seconds, plans skipped, prior)
    memory_margin: float = 0.0
    prediction_note: str = "no predictions"
    prediction_s: float = 0.0
    prior_labels: tuple[str, ...] = ()

    @property
    def measured(self) -> list[TrialRecord]:
        return [r for r in self.records if r.measured]

    @property
    def skipped(self) -> list[TrialRecord]:
        """Plans predicted over the memory budget or predicted to lose (step time): recorded, never run."""
        return [r for r in self.records if r.status in ("predicted-infeasible", "predicted-slower")]

    @property
    def over_budget_runs(self) -> int:
        """Runs that went over the memory budget anyway (what the prediction is there to make zero)."""
        return sum(r.over_budget for r in self.records)


def best_record(records: list[TrialRecord]) -> TrialRecord | None:
    """The fastest feasible measured trial, or None."""
    feasible = [r for r in records if r.status == "ok" and r.result and r.result.samples_per_s]
    return max(feasible, key=lambda r: r.result.samples_per_s, default=None)


class Recorders:
    """The trial recorders of the study's loop (``study._Loop``), which holds the state they write:
    ``study`` (optuna), ``counts``, ``repeats``, ``seen`` (plan key -> trial number), ``predictions``,
    ``check`` (the step-time model), ``limit`` and ``margin`` (the memory budget), ``bar`` / ``task``
    (the progress display)."""

    def _skip(self, trial, key: str) -> None:
        """Record a plan predicted over the budget on ``trial`` (told as pruned and infeasible by the caller)."""
        point, pred = self.enumeration.valid[key], self.predictions[key]
        for name, value in (
            ("plan_key", key),
            ("steps", list(point.plan.names)),
            ("plan_json", point.plan.to_json(indent=None)),
            ("status", "predicted-infeasible"),
            ("predicted", pred.to_dict()),
        ):
            trial.set_user_attr(name, value)
        trial.set_user_attr(
            "reason",
            f"predicted peak {pred.peak_bytes / 2**20:.1f} MiB x (1 + margin {self.margin:g}) > "
            f"budget {self.limit / 2**20:.1f} MiB; not run",
        )
        trial.set_constraint("memory", (pred.peak_bytes - self.limit) / self.limit)
        self.seen[key] = trial.number

    def _tell_unrun(self, trial) -> None:
        """The time budget ran out between the proposal and its run: not run, proposed again on resume."""
        import optuna

        trial.set_user_attr("status", "failed")
        trial.set_user_attr("reason", "stopped by the study's time limit before it ran")
        trial.set_user_attr("retryable", True)
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _tell_invalid(self, trial, point: Point) -> None:
        import optuna

        self.counts["invalid"] += 1
        self.repeats += 1
        trial.set_user_attr("status", "invalid")
        trial.set_user_attr("reason", point.error)
        trial.set_constraint("valid", 1.0)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def _tell_skipped(self, trial, point: Point) -> None:
        """A plan predicted over the memory budget: recorded with its prediction, not run (no trial cost)."""
        import optuna

        self.counts["skipped"] += 1
        self.repeats += 1
        self._skip(trial, point.key)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        self.bar.console.print(
            f"  #{trial.number} {escape(TrialRecord(trial.number, '', dict(point.assignment)).plan_label)}: "
            f"[dim]predicted over the budget, not run[/dim]"
        )

    def _tell_slower(self, trial, point: Point, why: str) -> None:
        """A plan the step-time model says cannot win (:class:`~.predict.StepTimeCheck`): recorded, not run."""
        import optuna

        self.counts["skipped"] += 1
        self.repeats += 1
        self.seen[point.key] = trial.number
        for name, value in (("status", "predicted-slower"), ("reason", why)):
            trial.set_user_attr(name, value)
        trial.set_user_attr("predicted", self.predictions[point.key].to_dict())
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def _tell_duplicate(self, trial, point: Point) -> None:
        import optuna

        self.counts["duplicate"] += 1
        self.repeats += 1
        trial.set_user_attr("status", "duplicate")
        trial.set_user_attr("reason", f"same plan as trial {self.seen[point.key]}; not run again")
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _tell_failed(self, trial, point: Point, result: TrialResult, label: str, cut: bool) -> None:
        """A crash, OOM or hang; a trial cut by the study's own time limit may run again on resume."""
        import optuna

        trial.set_user_attr("status", "failed")
        trial.set_user_attr("reason", ("stopped by the study's time limit; " if cut else "") + (result.reason or ""))
        trial.set_user_attr("retryable", cut)
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if not cut:
            self.seen[point.key] = trial.number
        # the reason is the worker's text (gloo writes "[.../pair.cc:553]"): not rich markup
        self.bar.console.print(f"  #{trial.number} {escape(label)}: [red]failed[/red] — {escape(result.reason or '')}")
        self.bar.update(self.task, advance=1)

    def _tell_measured(self, trial, point: Point, result: TrialResult, label: str) -> None:
        """A measured plan: its throughput, and over-budget memory as an infeasible constraint."""
        self.seen[point.key] = trial.number
        self.check.observe(self.predictions.get(point.key), result)
        limit, peak = self.limit, result.peak_bytes
        over = limit is not None and peak is not None and peak > limit
        trial.set_user_attr("status", "infeasible" if over else "ok")
        if limit is not None:
            trial.set_constraint("memory", (peak - limit) / limit if peak is not None else 0.0)
            if over:
                trial.set_user_attr("reason", f"peak {peak / 2**20:.1f} MiB > budget {limit / 2**20:.1f} MiB")
        self.study.tell(trial, result.samples_per_s)
        mem = "" if peak is None else f", peak {peak / 2**20:.1f} MiB"
        flag = " [yellow]over budget[/yellow]" if over else ""
        self.bar.console.print(f"  #{trial.number} {escape(label)}: {result.samples_per_s:.1f} samples/s{mem}{flag}")
        best = best_record([TrialRecord.from_frozen(t) for t in self.study.trials])
        self.bar.update(self.task, advance=1, best=f"best {best.result.samples_per_s:.1f} samples/s" if best else "")

"""What a search found: one record per trial of the study, and the search's result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composable_atorch.auto.predict import Prediction
from composable_atorch.auto.preflight import PreflightResult
from composable_atorch.auto.space import ABSENT, Enumeration, SearchSpace
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

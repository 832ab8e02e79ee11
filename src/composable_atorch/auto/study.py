"""search(): an optuna study over the compose space — the fastest plan that fits the memory budget.

Each proposal of the sampler is an assignment of the space (:mod:`.space`). compose() rejects an
invalid one before it costs anything (told to optuna as pruned and infeasible, so the sampler
learns to avoid it); a plan already measured is answered from the study, not run again; a new
plan runs in fresh worker processes (:mod:`.trial`). Throughput is the objective (maximized);
the memory budget is an optuna constraint (``trial.set_constraint``: over-budget plans are
infeasible). Studies persist in sqlite and resume by name: earlier trials are kept and not re-run.
Before the study the workload trains once with no plan (:mod:`.preflight`): an error no plan can
fix stops the search at once. Settings come as policy values (:mod:`.policy`). The space is
built by :func:`.space.build_space`; what each outcome records is :mod:`.records`'s.

Before the study every valid plan is also predicted (:mod:`.predict`, no plan runs for it): a plan
predicted over the memory budget is recorded as infeasible with its prediction and never run, and
the plans predicted fastest among those that fit are enqueued first, a prior for the sampler.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import Any

from composable_atorch.auto.onpaper import PaperResult, plan_on_paper, printer
from composable_atorch.auto.policy import (
    Budget,
    SpaceOptions,
    StudyOptions,
    TrialSettings,
    make_sampler,
    policies_from_keywords,
)
from composable_atorch.auto.predict import (
    Estimator,
    Predictor,
    StepTimeCheck,
    default_estimator,
    first_to_measure,
    predictions_note,
)
from composable_atorch.auto.preflight import in_process_limit, preflight, preflight_in_child, user_code_limit
from composable_atorch.auto.records import Recorders, SearchResult, TrialRecord, best_record
from composable_atorch.auto.space import build_space
from composable_atorch.auto.trial import ProcessRunner, TrialResult
from composable_atorch.auto.workload import Workload
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment

__all__ = ["search"]

#: Consecutive proposals that are invalid or already measured before an untried neighbour of the
#: best plan is enqueued (samplers on small categorical spaces keep proposing their favourite).
MAX_REPEATS = 3


def search(
    workload: Workload | Callable[[], Any],
    *args: Any,
    trial: TrialSettings | None = None,
    budget: Budget | None = None,
    space: SpaceOptions | None = None,
    study: StudyOptions | None = None,
    env: Environment | None = None,
    runner: Callable[..., TrialResult] | None = None,
    progress: bool = True,
    estimator: Estimator | None = None,
    on_paper: bool = False,
    **legacy: Any,
) -> SearchResult | PaperResult:
    """Search the plans of the registered transforms for the fastest one that fits the memory budget.

    ``workload`` (:class:`~composable_atorch.auto.workload.Workload`) is what every trial trains: its
    factories are sent to fresh processes, so they must be importable or picklable. ``trial`` says
    how one plan is measured (world size, steps, time limit), ``budget`` what the search may spend,
    ``space`` which plans are searched, ``study`` how the optuna study runs (see :mod:`.policy`).
    ``runner(plan, timeout=...)`` replaces the process runner (benchmarks replay measured tables
    with it). ``env`` overrides the detected environment (its world size is ``trial.world_size``).
    ``estimator`` replaces :func:`composable_atorch.estimate.estimate` for the predictions (used
    when ``study.predict``; see :mod:`.predict`); a :class:`~.predict.Predictor` is used as it is
    (its cache shared between searches).

    ``on_paper=True`` plans for a cluster this machine is not: ``env`` is that cluster
    (``Environment(world_size=64, nodes=8, device="cuda", hardware="h100-sxm")``), every plan is priced
    by the estimate there and none runs; it returns a :class:`~.onpaper.PaperResult` (the plans that fit,
    ranked by predicted tokens/s per device; see :mod:`.onpaper`). ``trial`` and ``study`` do not apply.

    The 0.x call ``search(model_fn, optim_fn, dataset, loss_fn, world_size=..., batch_size=...,
    n_trials=..., ...)`` still works: its keywords are sorted into the same policies
    (:data:`LEGACY_KEYWORDS`).
    """
    if on_paper:
        if not isinstance(workload, Workload) or args or legacy or trial is not None or study is not None:
            raise TypeError(
                "search(workload, on_paper=True, env=Environment(...), budget=, space=): a Workload, no trial=/study="
            )
        show = printer() if progress else None
        return plan_on_paper(workload, env, budget=budget, space=space, progress=show, estimator=estimator)
    if not isinstance(workload, Workload):
        if len(args) != 3 or any(p is not None for p in (trial, budget, space, study)):
            raise TypeError(
                "search(workload, *, trial=, budget=, space=, study=) or the 0.x form "
                "search(model_fn, optim_fn, dataset, loss_fn, world_size=, batch_size=, ...)"
            )
        workload, trial, budget, space, study = policies_from_keywords(workload, *args, **legacy)
    elif args or legacy:
        raise TypeError(
            f"search(workload, ...) takes only policy keywords (trial=, budget=, space=, study=); got "
            f"{len(args)} more positional and {sorted(legacy)}"
        )
    trial, budget = trial or TrialSettings(), budget or Budget()
    space, study = space or SpaceOptions(), study or StudyOptions()
    # the budget's clock starts now: the preflight and every prediction count against it
    started = time.monotonic()
    deadline = None if budget.time_limit is None else started + budget.time_limit
    checked = None
    in_child = runner is None  # a custom runner (a replay) runs no process: neither does the preflight
    if runner is None:
        runner = ProcessRunner(workload, trial)  # checks the workload's picklability
    if study.preflight:
        # raises WorkloadError: no plan can fix the workload itself
        checked = preflight_in_child(workload, trial.timeout) if in_child else preflight(workload)
    env = (env or Environment.detect()).with_(world_size=trial.world_size)
    predictor = None
    if study.predict:
        estimator = estimator or default_estimator()
        predictor = (
            estimator if isinstance(estimator, Predictor) or estimator is None else Predictor(estimator, workload, env)
        )
        if predictor is not None:
            predictor.deadline = deadline
            predictor.timeout_s = min(predictor.timeout_s, trial.timeout)
    # the user's model is built and run here (tensor-parallel placement): under a limit (auto/preflight.py)
    with user_code_limit(in_process_limit(trial, budget, started), "listing the plans"):
        built, example = build_space(workload, env, space)
        enumeration = built.enumerate()
    loop = _Loop(built, enumeration, example, trial, budget, space, study, runner, progress, predictor, started)
    result = loop.run()
    result.preflight = checked
    return result


class _Loop(Recorders):
    """The ask/tell loop: each proposal is decided here, its outcome (invalid, duplicate, skipped,
    slower, failed, measured) recorded by :class:`~.records.Recorders`."""

    def __init__(
        self,
        built,
        enumeration,
        example,
        trial: TrialSettings,
        budget: Budget,
        space: SpaceOptions,
        study: StudyOptions,
        runner,
        progress: bool,
        predictor: Predictor | None,
        started: float,
    ):
        """The study over ``built`` (a :class:`~.space.SearchSpace`, its ``enumeration``), read from the
        ``example`` model."""
        import optuna

        self.space, self.enumeration, self.env, self.started = built, enumeration, built.env, started
        self.trial_settings, self.budget, self.runner, self.progress = trial, budget, runner, progress
        self.limit = budget.memory_bytes
        start_from = space.start_from
        # the space's classes, held here: the best plan's JSON is read back against them (core.codec)
        self.trusted = tuple({type(m) for m in example.modules()}) + tuple(
            obj for p in self.enumeration.valid.values() for obj in p.plan.named_objects()
        )
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        url = study.url
        self.study = optuna.create_study(
            direction="maximize",
            sampler=make_sampler(study.sampler, study.seed, study.n_startup_trials),
            storage=url,
            study_name=study.study_name or ("composable_atorch-search" if url else None),
            load_if_exists=True,
        )
        self.study.set_user_attr("memory_limit", self.limit)
        self.seen: dict[str, int] = {}
        for t in self.study.trials:
            rec = TrialRecord.from_frozen(t)
            if rec.measured and not t.user_attrs.get("retryable") and t.user_attrs.get("plan_key"):
                self.seen.setdefault(t.user_attrs["plan_key"], t.number)
        self.rng = random.Random(study.seed)
        self.predictor, self.margin, self.predictions, self.prediction_s = predictor, budget.memory_margin, {}, 0.0
        self.check = StepTimeCheck()  # step-time model vs the trials (auto/predict.py)
        self.earlier_skips = {
            t.user_attrs.get("plan_key"): t.number
            for t in self.study.trials
            if t.user_attrs.get("status") == "predicted-infeasible"
        }
        if predictor is not None:
            self._predict_ahead(study.predict_ahead_s)
        untried = [k for k in self.enumeration.valid if k not in self.seen]
        n = budget.n_trials
        self.target = len(untried) if n is None else min(n, len(untried))
        self.counts = {"measured": 0, "invalid": 0, "duplicate": 0, "dry_invalid": 0, "skipped": 0}
        self.repeats = 0
        first = [start_from] if start_from is not None else []
        if study.baseline_first and not self._baseline_loses():
            first.append(None)  # the plan with no transforms: the reference every other plan is against
        for plan in first:
            self._enqueue_first(plan)
        self.prior_labels = self._enqueue_prior(study.prior)

    # -- predictions ------------------------------------------------------------------------
    def _predict_ahead(self, seconds: float) -> None:
        """Predict valid plans not measured yet, for up to ``seconds`` (in a seeded random order, so a
        cut-off favours no knob); record those over the budget, never to run. Plans left are
        predicted when the sampler proposes them."""
        import optuna

        start = time.monotonic()
        if self.budget.time_limit is not None:  # predictions spend the search's time budget too
            seconds = min(seconds, self.started + self.budget.time_limit - start)
        keys = [k for k in self.enumeration.valid if k not in self.seen]
        self.rng.shuffle(keys)
        for key in keys:
            if time.monotonic() - start > seconds:
                break
            if self._prediction(key).over(self.limit, self.margin):
                if key in self.earlier_skips:  # a resumed study recorded it already
                    self.seen[key] = self.earlier_skips[key]
                    continue
                self.study.enqueue_trial(dict(self.enumeration.valid[key].assignment), skip_if_exists=False)
                trial = self.study.ask()
                trial.set_user_attr("assignment", dict(self.enumeration.valid[key].assignment))
                self._skip(trial, key)
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        self.prediction_s = time.monotonic() - start

    def _baseline_loses(self) -> bool:
        """The baseline predicted to lose before any trial (:meth:`~.predict.StepTimeCheck.loses_unmeasured`):
        recorded as predicted slower, not run (a trial the budget cannot spare)."""
        point = self.space.baseline(self.enumeration)
        if self.predictor is None or point is None or point.key in self.seen:
            return False
        fits = [p for p in self.predictions.values() if not p.over(self.limit, self.margin)]
        why = self.check.loses_unmeasured(self._prediction(point.key), fits)
        if why is None:
            return False
        self.study.enqueue_trial(dict(point.assignment), skip_if_exists=False)
        trial = self.study.ask()
        for name, value in (("assignment", dict(point.assignment)), ("plan_key", point.key)):
            trial.set_user_attr(name, value)
        trial.set_user_attr("steps", list(point.plan.names))
        self._tell_slower(trial, point, f"the baseline: {why}")
        self.repeats = 0
        return True

    def _prediction(self, key: str):
        if key not in self.predictions:
            self.predictions[key] = self.predictor(self.enumeration.valid[key].plan)
        return self.predictions[key]

    def _enqueue_prior(self, count: int) -> tuple[str, ...]:
        """Enqueue the plans the predictions say to measure first (:func:`~.predict.first_to_measure`)."""
        chosen = first_to_measure(self.predictions, self.seen, count)
        for key in chosen:
            self.study.enqueue_trial(dict(self.enumeration.valid[key].assignment), skip_if_exists=False)
        return tuple(TrialRecord(0, "", dict(self.enumeration.valid[k].assignment)).plan_label for k in chosen)

    def prediction_note(self) -> str:
        if self.predictor is None:
            return "no predictions (no estimator)"
        over = sum(r == "predicted-infeasible" for r in self._statuses())
        counts = predictions_note(self.predictions, len(self.enumeration.valid), self.prediction_s, over)
        return counts + self._pick_note()

    def _pick_note(self) -> str:
        """The step-time model against the best measured plan (auto/predict.py)."""
        best = best_record([TrialRecord.from_frozen(t) for t in self.study.trials])
        if best is None or self.predictor is None:
            return ""
        key = self.study.trials[best.number].user_attrs.get("plan_key")
        slower = sum(r == "predicted-slower" for r in self._statuses())
        return f"; {slower} predicted slower, not run; " + self.check.pick_note(self.predictions.get(key), best.result)

    def _statuses(self) -> list[str]:
        return [t.user_attrs.get("status", "") for t in self.study.trials]

    def _enqueue_first(self, plan: Plan | None) -> None:
        """Enqueue ``plan`` (a loaded strategy) or, for None, the baseline, unless measured already."""
        point = self.space.baseline(self.enumeration) if plan is None else self.space.point_of(plan)
        if point is not None and point.key not in self.seen:
            self.study.enqueue_trial(dict(point.assignment), skip_if_exists=False)

    # -- the loop ---------------------------------------------------------------------------
    def _stop_reason(self, remaining: float | None) -> str | None:
        n_trials, time_limit = self.budget.n_trials, self.budget.time_limit
        if self.counts["measured"] >= self.target:
            return "every valid plan measured" if n_trials is None or self.target < n_trials else f"n_trials={n_trials}"
        if all(k in self.seen for k in self.enumeration.valid):
            return "every valid plan measured or predicted over the budget"
        if remaining is not None and remaining <= 0:
            return f"time_limit={time_limit:g} s"
        return None

    def run(self) -> SearchResult:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=False, quiet=not self.progress, soft_wrap=not sys.stdout.isatty())  # a log: unwrapped
        columns = (
            TextColumn("[bold]search"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[best]}"),
            TimeElapsedColumn(),
        )
        start, stopped_by = self.started, ""
        with Progress(*columns, console=console, disable=not self.progress, transient=False) as bar:
            self.bar, self.task = bar, bar.add_task("search", total=self.target, best="")
            while True:
                limit = self.budget.time_limit
                remaining = None if limit is None else limit - (time.monotonic() - start)
                stopped_by = self._stop_reason(remaining)
                if stopped_by:
                    break
                self._step(remaining)
        records = [TrialRecord.from_frozen(t) for t in self.study.trials]
        best = best_record(records)
        c = self.counts
        return SearchResult(
            study=self.study,
            space=self.space,
            enumeration=self.enumeration,
            records=records,
            best=best,
            best_plan=Plan.from_json(best.plan_json, env=self.env, allow=self.trusted) if best else None,
            memory_limit=self.limit,
            wall_time=time.monotonic() - start,
            measured_now=c["measured"],
            invalid_proposals=c["invalid"],
            duplicate_proposals=c["duplicate"],
            dry_runs_on_invalid=c["dry_invalid"],
            stopped_by=stopped_by,
            memory_margin=self.budget.memory_margin,
            prediction_note=self.prediction_note(),
            prediction_s=self.prediction_s,
            prior_labels=self.prior_labels,
        )

    def _step(self, remaining: float | None) -> None:
        """Ask for one proposal and tell optuna its outcome."""
        if self.repeats >= MAX_REPEATS:
            # the sampler keeps proposing seen plans: an untried one nearest the best feasible plan so far
            best = best_record([TrialRecord.from_frozen(t) for t in self.study.trials])
            anchor = None if best is None else best.assignment
            self.study.enqueue_trial(self.enumeration.near(anchor, self.seen, self.rng), skip_if_exists=False)
            self.repeats = 0
        trial = self.study.ask()
        assignment = self.space.suggest(trial)
        point = self.space.point(assignment)
        trial.set_user_attr("assignment", assignment)
        if not point.valid:
            return self._tell_invalid(trial, point)
        trial.set_user_attr("plan_key", point.key)
        trial.set_user_attr("steps", list(point.plan.names))
        if point.key in self.seen:
            return self._tell_duplicate(trial, point)
        if self.predictor is not None and self._prediction(point.key).over(self.limit, self.margin):
            return self._tell_skipped(trial, point)
        if self.predictor is not None and (why := self.check.loses(self._prediction(point.key))):  # auto/predict.py
            return self._tell_slower(trial, point, why)
        if remaining is not None:  # the prediction spent some of it
            remaining = self.started + self.budget.time_limit - time.monotonic()
            if remaining <= 0:
                return self._tell_unrun(trial)
        self.repeats = 0
        # an independent check on compose(): the plan must be one the enumeration found valid
        self.counts["dry_invalid"] += point.key not in self.enumeration.valid
        full = self.trial_settings.timeout
        timeout = full if remaining is None else max(1.0, min(full, remaining))
        result = self.runner(point.plan, timeout=timeout)
        self.counts["measured"] += 1
        unpredicted = self.predictions.get(point.key)
        if unpredicted is not None and unpredicted.measure:  # said in the trials table, not dropped silently
            trial.set_user_attr("reason", unpredicted.reason)
        trial.set_user_attr("plan_json", point.plan.to_json(indent=None))
        if point.key in self.predictions:
            trial.set_user_attr("predicted", self.predictions[point.key].to_dict())
        trial.set_user_attr("result", {k: v for k, v in result.to_dict().items() if k not in ("losses", "sample_ids")})
        label = TrialRecord(trial.number, "", assignment).plan_label
        if not result.ok:
            cut = remaining is not None and timeout < full and (result.reason or "").startswith("timeout")
            return self._tell_failed(trial, point, result, label, cut)
        return self._tell_measured(trial, point, result, label)

"""search(): an optuna study over the compose space — the fastest plan that fits the memory budget.

Each proposal of the sampler is an assignment of the space (:mod:`.space`). compose() rejects an
invalid one before it costs anything (told to optuna as pruned and infeasible, so the sampler
learns to avoid it); a plan already measured is answered from the study, not run again; a new
plan runs in fresh worker processes (:mod:`.trial`). Throughput is the objective (maximized);
``memory_limit`` is an optuna constraint (``trial.set_constraint``: over-budget plans are
infeasible). Studies persist in sqlite and resume by name: earlier trials are kept and not re-run.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composable_atorch.auto.space import ABSENT, Enumeration, SearchSpace, block_classes
from composable_atorch.auto.trial import TrialResult, TrialSettings, check_picklable, run_trial
from composable_atorch.auto.worker import Workload
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError

#: Consecutive proposals that are invalid or already measured before an untried neighbour of the
#: best plan is enqueued (samplers on small categorical spaces keep proposing their favourite).
MAX_REPEATS = 3
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: Any, field_name: str = "memory_limit") -> int | None:
    """``None``, a number of bytes, or a string such as ``"300MiB"`` / ``"2GB"``."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(field_name, value, "a positive number of bytes or a string such as '300MiB' or '2GB'")


def storage_url(storage: Any) -> str | None:
    """optuna storage URL: a URL as given; a file path becomes a sqlite URL."""
    if storage is None or (isinstance(storage, str) and "://" in storage):
        return storage
    if isinstance(storage, str | os.PathLike):
        path = Path(storage).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    raise ConfigError("storage", storage, "None, an optuna storage URL or a path to a sqlite file")


@dataclass
class TrialRecord:
    """One trial of the study as the report shows it."""

    number: int
    status: str  # ok | infeasible | failed | invalid | duplicate
    assignment: dict[str, str]
    plan_json: str | None = None
    steps: tuple[str, ...] = ()
    result: TrialResult | None = None
    reason: str | None = None

    @classmethod
    def from_frozen(cls, trial) -> TrialRecord:
        attrs = trial.user_attrs
        result = TrialResult.from_dict(attrs["result"]) if attrs.get("result") else None
        return cls(
            number=trial.number, status=attrs.get("status", trial.state.name.lower()),
            assignment=dict(attrs.get("assignment") or trial.params), plan_json=attrs.get("plan_json"),
            steps=tuple(attrs.get("steps", ())), result=result, reason=attrs.get("reason"),
        )

    @property
    def measured(self) -> bool:
        return self.status in ("ok", "infeasible", "failed")

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

    @property
    def measured(self) -> list[TrialRecord]:
        return [r for r in self.records if r.measured]


def make_sampler(sampler: Any, seed: int | None, n_startup_trials: int):
    """``"tpe"`` (default), ``"gp"``, ``"random"``, or any optuna sampler instance."""
    import optuna

    if isinstance(sampler, optuna.samplers.BaseSampler):
        return sampler
    if sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials, multivariate=True)
    if sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials)
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError("sampler", sampler, "'tpe', 'gp', 'random' or an optuna sampler instance")


class ProcessRunner:
    """Runs a plan in fresh worker processes (the default runner)."""

    def __init__(self, workload: Workload, settings: TrialSettings):
        self.workload, self.settings = workload, settings

    def __call__(self, plan: Plan, *, timeout: float) -> TrialResult:
        settings = TrialSettings(**{**self.settings.__dict__, "timeout": timeout})
        return run_trial(plan.to_json(), self.workload, settings)


def _example_model(model_fn):
    """The model, built on the meta device when it can be (no memory), to find its blocks."""
    import torch

    try:
        with torch.device("meta"):
            return model_fn()
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; build them for real
        return model_fn()


def search(
    model_fn: Callable[[], Any],
    optim_fn: Callable[..., Any],
    dataset: Any,
    loss_fn: Callable[[Any, Any], Any],
    *,
    world_size: int,
    batch_size: int,
    n_trials: int | None = None,
    time_limit: float | None = None,
    memory_limit: int | str | None = None,
    excluded: Iterable[str] = (),
    included: Iterable[str] = (),
    storage: Any = None,
    study_name: str | None = None,
    seed: int | None = None,
    sampler: Any = "tpe",
    n_startup_trials: int = 4,
    baseline_first: bool = True,
    start_from: Plan | None = None,
    allow_compile: bool = False,
    customize: Callable[[Plan], Plan] | None = None,
    trial_timeout: float = 120.0,
    warmup_steps: int = 2,
    measure_steps: int = 5,
    loader_kwargs: dict | None = None,
    env: Environment | None = None,
    runner: Callable[..., TrialResult] | None = None,
    progress: bool = True,
) -> SearchResult:
    """Search the plans of the registered transforms for the fastest one that fits ``memory_limit``.

    ``model_fn()`` builds a fresh model, ``optim_fn(model)`` its optimizer (or an optimizer class),
    ``loss_fn(model, batch)`` the loss of one batch; ``batch_size`` is the global batch. Each is
    sent to fresh processes, so they must be importable or picklable. ``n_trials`` counts plans
    measured by this call (default: every valid plan); ``time_limit`` (seconds) stops the study and
    cuts the running trial. ``excluded`` / ``included`` drop or pin transform kinds. ``storage`` (a
    sqlite path or URL) with ``study_name`` persists the study; calling again resumes it.
    ``start_from`` (a plan) is measured first and its configs join the space (fine-tuning a
    loaded strategy). ``allow_compile`` lets torch.compile offer candidates (a cold compile costs
    minutes per trial on a small CPU). ``customize(plan) -> plan`` adjusts every composed plan before
    it runs (the facade sets ``find_unused_parameters`` / the sampler class this way). ``runner(plan, timeout=...)`` replaces the process runner (benchmarks
    replay measured tables with it).
    """
    import optuna
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("batch_size", batch_size, "the global batch size, an integer >= 1")
    if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
        raise ConfigError("n_trials", n_trials, "None (every valid plan) or an integer >= 1")
    if time_limit is not None and (not isinstance(time_limit, int | float) or time_limit <= 0):
        raise ConfigError("time_limit", time_limit, "None or a positive number of seconds")
    for name, value in (("excluded", excluded), ("included", included)):
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise ConfigError(name, value, "a list of transform names, e.g. ['checkpoint']")
    limit = parse_bytes(memory_limit)
    settings = TrialSettings(world_size=world_size, warmup_steps=warmup_steps, measure_steps=measure_steps, timeout=trial_timeout)
    workload = Workload(model_fn, optim_fn, dataset, loss_fn, batch_size, dict(loader_kwargs or {}), seed or 0)
    if runner is None:
        check_picklable(workload)
        runner = ProcessRunner(workload, settings)
    url = storage_url(storage)
    env = (env or Environment.detect()).with_(world_size=world_size)
    from composable_atorch.core.transform import SearchContext

    context = SearchContext(
        env=env, block_classes=block_classes(_example_model(model_fn)), batch_size=batch_size, allow_compile=allow_compile
    )
    space = SearchSpace(
        context, excluded=excluded, included=included, extra=start_from.requested if start_from else (), customize=customize
    )
    enumeration = space.enumerate()

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        direction="maximize", sampler=make_sampler(sampler, seed, n_startup_trials), storage=url,
        study_name=study_name or ("composable_atorch-search" if url else None), load_if_exists=True,
    )
    study.set_user_attr("memory_limit", limit)
    seen: dict[str, int] = {}
    for t in study.trials:
        rec = TrialRecord.from_frozen(t)
        if rec.measured and not t.user_attrs.get("retryable") and t.user_attrs.get("plan_key"):
            seen.setdefault(t.user_attrs["plan_key"], t.number)
    untried = [k for k in enumeration.valid if k not in seen]
    budget = len(untried) if n_trials is None else min(n_trials, len(untried))
    rng = random.Random(seed)

    def enqueue(assignment: dict[str, str]) -> None:
        study.enqueue_trial(assignment, skip_if_exists=False)

    first = [start_from] if start_from is not None else []
    if baseline_first:
        first.append(None)  # the plan with no transforms: the reference every other plan is against
    for plan in first:
        assignment = space.assignment_of(plan) if plan is not None else {k: ABSENT for k in space.kinds}
        if assignment and all(label in space.options[k] for k, label in assignment.items()):
            point = space.point(assignment)
            if point.valid and point.key not in seen:
                enqueue(assignment)

    console = Console(stderr=False, quiet=not progress)
    counts = {"measured": 0, "invalid": 0, "duplicate": 0, "dry_invalid": 0}
    repeats, stopped_by, start = 0, "", time.monotonic()
    columns = (TextColumn("[bold]search"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[best]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("search", total=budget, best="")
        while True:
            if counts["measured"] >= budget:
                stopped_by = "every valid plan measured" if n_trials is None or budget < n_trials else f"n_trials={n_trials}"
                break
            remaining = None if time_limit is None else time_limit - (time.monotonic() - start)
            if remaining is not None and remaining <= 0:
                stopped_by = f"time_limit={time_limit:g} s"
                break
            if repeats >= MAX_REPEATS:
                enqueue(_neighbour(study, enumeration, seen, rng))
                repeats = 0
            trial = study.ask()
            assignment = space.suggest(trial)
            point = space.point(assignment)
            trial.set_user_attr("assignment", assignment)
            if not point.valid:
                counts["invalid"] += 1
                repeats += 1
                trial.set_user_attr("status", "invalid")
                trial.set_user_attr("reason", point.error)
                trial.set_constraint("valid", 1.0)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            key = point.key
            trial.set_user_attr("plan_key", key)
            trial.set_user_attr("steps", list(point.plan.names))
            if key in seen:
                counts["duplicate"] += 1
                repeats += 1
                trial.set_user_attr("status", "duplicate")
                trial.set_user_attr("reason", f"same plan as trial {seen[key]}; not run again")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            repeats = 0
            # an independent check on compose(): the plan must be one the enumeration found valid
            counts["dry_invalid"] += key not in enumeration.valid
            timeout = trial_timeout if remaining is None else max(1.0, min(trial_timeout, remaining))
            result = runner(point.plan, timeout=timeout)
            counts["measured"] += 1
            trial.set_user_attr("plan_json", point.plan.to_json(indent=None))
            trial.set_user_attr("result", {k: v for k, v in result.to_dict().items() if k != "losses"})
            label = TrialRecord(trial.number, "", assignment).plan_label
            if not result.ok:
                cut = remaining is not None and timeout < trial_timeout and (result.reason or "").startswith("timeout")
                trial.set_user_attr("status", "failed")
                trial.set_user_attr("reason", ("stopped by the study's time limit; " if cut else "") + (result.reason or ""))
                trial.set_user_attr("retryable", cut)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                if not cut:
                    seen[key] = trial.number
                bar.console.print(f"  #{trial.number} {label}: [red]failed[/red] — {result.reason}")
                bar.update(task, advance=1)
                continue
            seen[key] = trial.number
            over = limit is not None and result.peak_bytes is not None and result.peak_bytes > limit
            status = "infeasible" if over else "ok"
            trial.set_user_attr("status", status)
            if limit is not None:
                trial.set_constraint("memory", (result.peak_bytes - limit) / limit if result.peak_bytes is not None else 0.0)
                if over:
                    trial.set_user_attr("reason", f"peak {result.peak_bytes / 2**20:.1f} MiB > budget {limit / 2**20:.1f} MiB")
            study.tell(trial, result.samples_per_s)
            mem = "" if result.peak_bytes is None else f", peak {result.peak_bytes / 2**20:.1f} MiB"
            flag = " [yellow]over budget[/yellow]" if over else ""
            bar.console.print(f"  #{trial.number} {label}: {result.samples_per_s:.1f} samples/s{mem}{flag}")
            best = _best([TrialRecord.from_frozen(t) for t in study.trials])
            bar.update(task, advance=1, best=f"best {best.result.samples_per_s:.1f} samples/s" if best else "")

    records = [TrialRecord.from_frozen(t) for t in study.trials]
    best = _best(records)
    best_plan = Plan.from_json(best.plan_json, env=env) if best else None
    return SearchResult(
        study=study, space=space, enumeration=enumeration, records=records, best=best, best_plan=best_plan,
        memory_limit=limit, wall_time=time.monotonic() - start, measured_now=counts["measured"],
        invalid_proposals=counts["invalid"], duplicate_proposals=counts["duplicate"],
        dry_runs_on_invalid=counts["dry_invalid"], stopped_by=stopped_by,
    )


def _neighbour(study, enumeration: Enumeration, seen: dict[str, int], rng: random.Random) -> dict[str, str]:
    """An untried plan one knob (or the fewest knobs) away from the best feasible plan so far."""
    left = [enumeration.valid[k] for k in enumeration.valid if k not in seen]
    best = _best([TrialRecord.from_frozen(t) for t in study.trials])
    if best is None:
        return dict(rng.choice(left).assignment)
    anchor = best.assignment

    def distance(point) -> int:
        return sum(anchor.get(knob) != label for knob, label in point.assignment)

    nearest = min(distance(p) for p in left)
    return dict(rng.choice([p for p in left if distance(p) == nearest]).assignment)


def _best(records: list[TrialRecord]) -> TrialRecord | None:
    feasible = [r for r in records if r.status == "ok" and r.result and r.result.samples_per_s]
    return max(feasible, key=lambda r: r.result.samples_per_s, default=None)

"""The search's settings as a few policy values (as ``fully_shard`` takes ``mp_policy=``), each checked
when it is made, with the field, value and what is allowed in the error.

    search(workload, trial=TrialSettings(world_size=2), budget=Budget(n_trials=8, memory_limit="40MiB"),
           space=SpaceOptions(excluded=("fp8",)), study=StudyOptions(storage="runs/s.db", study_name="gpt"))

* :class:`Budget` — how much the search may spend: plans measured, seconds, memory per rank.
* :class:`SpaceOptions` — which plans are searched.
* :class:`StudyOptions` — the optuna study: persistence, sampler, seed, what runs first.
* :class:`TrialSettings` — how one plan is measured (world size, steps, time limit); the trial
  runner (:mod:`.trial`) reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composable_atorch.auto.workload import Workload
from composable_atorch.errors import ConfigError
from composable_atorch.units import parse_bytes


def storage_url(storage: Any) -> str | None:
    """optuna storage URL: a URL as given; a file path becomes a sqlite URL."""
    if storage is None or (isinstance(storage, str) and "://" in storage):
        return storage
    if isinstance(storage, str | os.PathLike):
        path = Path(storage).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    raise ConfigError("storage", storage, "None, an optuna storage URL or a path to a sqlite file")


def _names(field_name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(field_name, value, "a list of transform names, e.g. ['checkpoint']")
    return tuple(value)


@dataclass(frozen=True)
class Budget:
    """What the search may spend. ``n_trials``: plans measured by this call (None: every valid plan);
    ``time_limit``: seconds for the whole search (it cuts the running trial); ``memory_limit``: peak
    bytes per rank (or "300MiB"), over-budget plans are infeasible.

    ``memory_margin``: the safety margin on predicted memory (a fraction). Where the estimate
    predicts a plan's peak, the plan runs only if ``predicted peak x (1 + memory_margin) <=
    memory_limit``; the others are recorded as infeasible with their prediction and cost no trial.
    A larger margin spends fewer trials over the budget when the estimate is low, and skips more
    plans that would just have fit; 0.03 covers the estimate's error measured on the demo's plans
    (see benchmarks/search.py)."""

    n_trials: int | None = None
    time_limit: float | None = None
    memory_limit: int | str | None = None
    memory_margin: float = 0.03

    def __post_init__(self):
        if (
            isinstance(self.memory_margin, bool)
            or not isinstance(self.memory_margin, int | float)
            or not 0 <= self.memory_margin < 1
        ):
            raise ConfigError("memory_margin", self.memory_margin, "a fraction >= 0 and < 1, e.g. 0.03 (3 %)")
        if self.n_trials is not None and (
            not isinstance(self.n_trials, int) or isinstance(self.n_trials, bool) or self.n_trials < 1
        ):
            raise ConfigError("n_trials", self.n_trials, "None (every valid plan) or an integer >= 1")
        if self.time_limit is not None and (not isinstance(self.time_limit, int | float) or self.time_limit <= 0):
            raise ConfigError("time_limit", self.time_limit, "None or a positive number of seconds")
        parse_bytes(self.memory_limit)

    @property
    def memory_bytes(self) -> int | None:
        return parse_bytes(self.memory_limit)


@dataclass(frozen=True)
class SpaceOptions:
    """Which plans are searched. ``excluded`` / ``included`` drop or pin transform kinds;
    ``start_from`` (a plan) is measured first and its configs join the space (fine-tuning a loaded
    strategy); ``allow_compile`` lets torch.compile offer candidates (a cold compile costs minutes
    per trial on a small CPU); ``customize(plan) -> plan`` adjusts every composed plan before it runs
    (the facade sets ``find_unused_parameters`` / the sampler class this way)."""

    excluded: tuple[str, ...] = ()
    included: tuple[str, ...] = ()
    start_from: Any = None  # a Plan
    allow_compile: bool = False
    customize: Callable[[Any], Any] | None = None

    def __post_init__(self):
        object.__setattr__(self, "excluded", _names("excluded", self.excluded))
        object.__setattr__(self, "included", _names("included", self.included))


@dataclass(frozen=True)
class StudyOptions:
    """The optuna study. ``storage`` (a sqlite path or URL) with ``study_name`` persists it; calling
    again resumes it. ``sampler``: "tpe", "gp", "random" or an optuna sampler. ``baseline_first``
    measures the plan with no requested transforms first. ``preflight`` trains the workload once in
    this process, with no plan, before the study, and stops at once on an error no plan can fix.
    ``predict`` asks :mod:`composable_atorch.estimate` for every plan's per-rank memory and step time
    before the study (no plan runs for it): plans predicted over the memory budget are not run, and
    the ``prior`` plans predicted fastest among those that fit are measured first (after the
    baseline, which runs first only where it is predicted to fit). An estimate costs about a second
    or two per plan here, so plans are predicted ahead of the study for ``predict_ahead_s``
    seconds at most (the prior comes from those), the others when the sampler proposes them."""

    storage: Any = None
    study_name: str | None = None
    seed: int | None = None
    sampler: Any = "tpe"
    n_startup_trials: int = 4
    baseline_first: bool = True
    preflight: bool = True
    predict: bool = True
    prior: int = 3
    predict_ahead_s: float = 60.0

    def __post_init__(self):
        if not isinstance(self.n_startup_trials, int) or self.n_startup_trials < 0:
            raise ConfigError("n_startup_trials", self.n_startup_trials, "an integer >= 0")
        if isinstance(self.prior, bool) or not isinstance(self.prior, int) or self.prior < 0:
            raise ConfigError("prior", self.prior, "an integer >= 0: plans predicted fastest, measured first")
        if (
            isinstance(self.predict_ahead_s, bool)
            or not isinstance(self.predict_ahead_s, int | float)
            or self.predict_ahead_s < 0
        ):
            raise ConfigError("predict_ahead_s", self.predict_ahead_s, "seconds >= 0 to predict plans before the study")

    @property
    def url(self) -> str | None:
        return storage_url(self.storage)


@dataclass(frozen=True)
class TrialSettings:
    """How one plan is measured: ``world_size`` worker processes, ``warmup_steps`` optimizer steps,
    then at least ``measure_steps`` timed ones; ``timeout`` seconds from spawn to exit (a trial still
    running then is a hang); ``measure_memory`` adds one more step under the memory tracker.

    A few steps are noise on a shared machine, so a trial goes on measuring until its figure is
    precise: until the relative standard error of its mean step (``std / sqrt(n) / mean``) is at
    most ``precision`` (0.01: about +-2% at 95%), or ``max_measure_steps`` steps, or ``max_measure_s``
    seconds of timed steps, whichever comes first. ``precision=None`` measures ``measure_steps`` only.
    """

    world_size: int = 2
    warmup_steps: int = 2
    measure_steps: int = 4
    #: seconds one trial may take, spawn to exit; a trial still running then is a hang
    timeout: float = 120.0
    measure_memory: bool = True
    precision: float | None = 0.01
    max_measure_steps: int = 40
    max_measure_s: float = 20.0

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "an integer >= 1")
        if self.precision is not None and (
            isinstance(self.precision, bool)
            or not isinstance(self.precision, int | float)
            or not 0 < self.precision < 1
        ):
            raise ConfigError("precision", self.precision, "None or a fraction > 0 and < 1, e.g. 0.01")
        if not isinstance(self.max_measure_steps, int) or self.max_measure_steps < 1:
            raise ConfigError("max_measure_steps", self.max_measure_steps, "an integer >= 1")
        if not isinstance(self.max_measure_s, int | float) or self.max_measure_s <= 0:
            raise ConfigError("max_measure_s", self.max_measure_s, "a positive number of seconds")
        for name in ("warmup_steps", "measure_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
                raise ConfigError(name, value, "a positive integer" if name == "measure_steps" else "an integer >= 0")
        if not isinstance(self.timeout, int | float) or self.timeout <= 0:
            raise ConfigError("trial timeout", self.timeout, "a positive number of seconds")


#: the keywords of the 0.x signature ``search(model_fn, optim_fn, dataset, loss_fn, **these)``
#: and the policy each one belongs to
LEGACY_KEYWORDS = {
    "world_size": "trial",
    "warmup_steps": "trial",
    "measure_steps": "trial",
    "trial_timeout": "trial",
    "n_trials": "budget",
    "time_limit": "budget",
    "memory_limit": "budget",
    "excluded": "space",
    "included": "space",
    "start_from": "space",
    "allow_compile": "space",
    "customize": "space",
    "storage": "study",
    "study_name": "study",
    "seed": "study",
    "sampler": "study",
    "n_startup_trials": "study",
    "baseline_first": "study",
    "preflight": "study",
    "batch_size": "workload",
    "loader_kwargs": "workload",
    "memory_margin": "budget",
    "predict": "study",
    "prior": "study",
    "predict_ahead_s": "study",
}


def policies_from_keywords(model_fn, optim_fn, dataset, loss_fn, **kwargs):
    """The 0.x call's four factories and keywords as ``(workload, trial, budget, space, study)``."""
    unknown = sorted(set(kwargs) - set(LEGACY_KEYWORDS))
    if unknown:
        raise TypeError(
            f"search() got unexpected keyword argument(s) {unknown}; "
            "pass trial=, budget=, space= and study= policies (composable_atorch.auto.policy)"
        )
    if "world_size" not in kwargs or "batch_size" not in kwargs:
        raise TypeError(
            "search(model_fn, optim_fn, dataset, loss_fn, ...) needs world_size= and batch_size=; "
            "or pass a Workload: search(workload, trial=TrialSettings(world_size=...))"
        )
    batch_size = kwargs.pop("batch_size")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError("batch_size", batch_size, "the global batch size, an integer >= 1")
    workload = Workload(
        model_fn,
        optim_fn,
        dataset,
        loss_fn,
        batch_size,
        dict(kwargs.pop("loader_kwargs", None) or {}),
        kwargs.get("seed") or 0,
    )
    groups: dict[str, dict] = {"trial": {}, "budget": {}, "space": {}, "study": {}}
    for key, value in kwargs.items():
        groups[LEGACY_KEYWORDS[key]]["timeout" if key == "trial_timeout" else key] = value
    groups["trial"].setdefault("measure_steps", 5)
    return (
        workload,
        TrialSettings(**groups["trial"]),
        Budget(**groups["budget"]),
        SpaceOptions(**groups["space"]),
        StudyOptions(**groups["study"]),
    )


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

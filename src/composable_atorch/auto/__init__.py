"""Auto mode: search the plans of the registered transforms for the fastest one that fits memory.

    workload = Workload(model_fn, optim_fn, dataset, loss_fn, batch_size=16)
    result = search(workload, trial=TrialSettings(world_size=2),
                    budget=Budget(n_trials=8, memory_limit="200MiB"),
                    study=StudyOptions(storage="runs/search.db", study_name="gpt"))
    result.best_plan            # a Plan: apply it, or save it with strategy.dump
    report.write_all(result, "runs/search")

:mod:`.policy` holds the settings, :mod:`.preflight` trains the workload once with no plan,
:mod:`.space` builds the space from the registry, :mod:`.predict` predicts each plan's memory
before it runs (plans predicted over the budget cost no trial), :mod:`.trial` measures one plan in
fresh processes, :mod:`.study` runs the optuna study, :mod:`.report` writes what it found.
"""

from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.predict import Prediction, Predictor
from composable_atorch.auto.preflight import preflight
from composable_atorch.auto.records import SearchResult, TrialRecord
from composable_atorch.auto.space import SearchSpace, block_classes, plan_key
from composable_atorch.auto.study import search
from composable_atorch.auto.trial import TrialResult, run_trial, train_plan
from composable_atorch.auto.workload import Workload

__all__ = [
    "Budget",
    "Prediction",
    "Predictor",
    "SpaceOptions",
    "StudyOptions",
    "SearchResult",
    "SearchSpace",
    "TrialRecord",
    "TrialResult",
    "TrialSettings",
    "Workload",
    "block_classes",
    "plan_key",
    "preflight",
    "run_trial",
    "search",
    "train_plan",
]

"""The search keeps its time budget (preflight and predictions included) and leaves no process behind."""

import time
import uuid

import pytest

from composable_atorch.auto import Budget, SpaceOptions, StudyOptions, TrialSettings, Workload, search
from composable_atorch.auto.predict import Predictor
from composable_atorch.data import TextDataset
from composable_atorch.errors import WorkloadError
from composable_atorch.models import GPT, GPTConfig

from auto_faults import EscapingStep, HangingGPT, adamw, lm_step, processes_with

pytestmark = pytest.mark.dist  # trials and the preflight spawn processes

BUDGET_S, TRIAL_S = 20.0, 12.0
#: spawning a process and importing torch, on 2 loaded cores (not a speed claim: the bound says the
#: search ended, where it used to wait for the hanging forward forever)
SPAWN_MARGIN_S = 30.0


def small_gpt():
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))


def only(*kinds):
    import composable_atorch as ca

    return SpaceOptions(excluded=tuple(sorted(set(ca.registry()) - set(kinds))))


def test_a_hanging_forward_ends_the_preflight_at_the_trial_timeout():
    workload = Workload(HangingGPT, adamw, TextDataset(16, limit=32), lm_step, 8)
    start = time.monotonic()
    with pytest.raises(WorkloadError, match=r"did not finish within 12 s"):
        search(
            workload,
            trial=TrialSettings(world_size=1, timeout=TRIAL_S),
            budget=Budget(n_trials=3, time_limit=BUDGET_S),
            study=StudyOptions(seed=0),
            progress=False,
        )
    assert time.monotonic() - start < BUDGET_S + TRIAL_S + SPAWN_MARGIN_S


class SlowEstimator:
    """Every prediction takes 4 s (a forward slow on fake tensors): 25 plans would take 100 s."""

    def __call__(self, plan, model, batch, **kwargs):
        time.sleep(4)
        raise RuntimeError("no estimate")


def test_predictions_and_hanging_trials_spend_the_budget_and_stop():
    workload = Workload(HangingGPT, adamw, TextDataset(16, limit=32), lm_step, 8)
    start = time.monotonic()
    result = search(
        workload,
        trial=TrialSettings(world_size=1, timeout=TRIAL_S),
        budget=Budget(time_limit=BUDGET_S),
        study=StudyOptions(seed=0, preflight=False, predict_ahead_s=600),
        estimator=SlowEstimator(),
        progress=False,
    )
    assert time.monotonic() - start < BUDGET_S + TRIAL_S + SPAWN_MARGIN_S
    assert result.stopped_by == f"time_limit={BUDGET_S:g} s"
    assert all(r.status == "failed" for r in result.measured)  # every trial hung and was cut


def test_the_predictor_starts_no_prediction_after_the_deadline():
    from composable_atorch.core.compose import compose
    from composable_atorch.environment import Environment

    calls = []
    workload = Workload(small_gpt, adamw, TextDataset(16, limit=32), lm_step, 8)
    predictor = Predictor(lambda *a, **k: calls.append(1), workload, Environment.detect())
    predictor.deadline = time.monotonic() - 1
    assert "budget is spent" in predictor(compose()).reason and calls == []


def test_a_trial_child_that_leaves_the_session_is_killed_with_the_trial():
    token = f"escaping-{uuid.uuid4().hex}"
    workload = Workload(small_gpt, adamw, TextDataset(16, limit=32), EscapingStep(token), 8)
    result = search(
        workload,
        trial=TrialSettings(world_size=1, warmup_steps=1, measure_steps=1, timeout=60),
        budget=Budget(n_trials=1),
        space=only("checkpoint"),
        study=StudyOptions(seed=0, predict=False),
        progress=False,
    )
    assert result.measured and result.measured[0].status == "ok"
    assert processes_with(token) == []  # the preflight's and the trial's escaped sleepers are gone

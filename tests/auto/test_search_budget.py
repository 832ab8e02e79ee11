"""The search keeps its time budget (preflight and predictions included) and leaves no process behind."""

import time
import uuid

import pytest

from composable_atorch.auto import Budget, SpaceOptions, StudyOptions, TrialSettings, Workload, search
from composable_atorch.auto.predict import Predictor
from composable_atorch.data import TextDataset
from composable_atorch.errors import WorkloadError
from composable_atorch.models import GPT, GPTConfig

from auto_faults import EscapingStep, HangingGPT, StubbornGPT, adamw, lm_step, processes_with

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = [pytest.mark.dist, pytest.mark.serial]  # trials and the preflight spawn processes

BUDGET_S, TRIAL_S = 20.0, 6.0
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
    with pytest.raises(WorkloadError, match=r"did not finish within 6 s"):
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


#: a few slow predictions spend it (6 s ends the search as surely as 20 s did: two 4 s predictions pass it)
PREDICT_BUDGET_S = 6.0


def test_predictions_and_hanging_trials_spend_the_budget_and_stop():
    workload = Workload(HangingGPT, adamw, TextDataset(16, limit=32), lm_step, 8)
    start = time.monotonic()
    result = search(
        workload,
        trial=TrialSettings(world_size=1, timeout=TRIAL_S),
        budget=Budget(time_limit=PREDICT_BUDGET_S),
        study=StudyOptions(seed=0, preflight=False, predict_ahead_s=600),
        estimator=SlowEstimator(),
        progress=False,
    )
    assert time.monotonic() - start < PREDICT_BUDGET_S + TRIAL_S + SPAWN_MARGIN_S
    assert result.stopped_by == f"time_limit={PREDICT_BUDGET_S:g} s"
    # the slow predictions spend most of the budget, so often no trial starts at all; any that did hung
    # and was cut (a hanging trial cut at its timeout is checked at world 2 in the tests below)
    assert all(r.status == "failed" for r in result.measured)


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


# -- issue 30: every part of the search that runs the user's code runs under the budget ----------------
HANG_BUDGET_S, HANG_TRIAL_S = 6.0, 4.0


@pytest.mark.parametrize("preflight", [True, False], ids=["preflight", "no-preflight"])
@pytest.mark.parametrize("predict", [True, False], ids=["predictions", "no-predictions"])
def test_a_hanging_forward_ends_the_search_at_world_2_in_every_option_combination(preflight, predict):
    """At world 2 the plans are listed by tracing the forward once (tensor-parallel placement), in the
    searching process: with the preflight off that hung forever (issue 30). Now the preflight's child,
    or the limit on the listing, ends the search with a WorkloadError naming what did not finish."""
    workload = Workload(StubbornGPT, adamw, TextDataset(16, limit=32), lm_step, 8)
    start = time.monotonic()
    with pytest.raises(WorkloadError, match=r"did not finish within") as caught:
        search(
            workload,
            trial=TrialSettings(world_size=2, timeout=HANG_TRIAL_S),
            budget=Budget(n_trials=3, time_limit=HANG_BUDGET_S),
            study=StudyOptions(seed=0, preflight=preflight, predict=predict),
            progress=False,
        )
    assert time.monotonic() - start < HANG_BUDGET_S + HANG_TRIAL_S + SPAWN_MARGIN_S
    assert ("with no plan" if preflight else "listing the plans") in str(caught.value)


def test_a_forward_hanging_in_the_predictions_is_cut_and_the_search_ends_within_its_budget():
    """World 1 (no tensor-parallel listing), no preflight, the real estimator: each prediction runs the
    forward on fake tensors in this process and is interrupted (even a forward that swallows
    exceptions); the trials hang in their own processes and are killed; the budget ends the search."""
    workload = Workload(StubbornGPT, adamw, TextDataset(16, limit=32), lm_step, 8)
    start = time.monotonic()
    result = search(
        workload,
        trial=TrialSettings(world_size=1, timeout=HANG_TRIAL_S),
        budget=Budget(time_limit=HANG_BUDGET_S),
        space=only("checkpoint"),
        study=StudyOptions(seed=0, preflight=False, predict=True),
        progress=False,
    )
    assert time.monotonic() - start < HANG_BUDGET_S + HANG_TRIAL_S + SPAWN_MARGIN_S
    assert result.stopped_by == f"time_limit={HANG_BUDGET_S:g} s"
    assert "did not finish within" in result.prediction_note
    assert all(r.status == "failed" for r in result.measured)


def test_the_time_limit_interrupts_a_loop_that_swallows_it_in_any_thread():
    import threading

    from composable_atorch.auto.preflight import PredictionTimeout, time_limit

    def stubborn():
        while True:
            try:
                time.sleep(0.2)
            except Exception:  # noqa: BLE001, S112 - a user's retry loop
                continue

    with pytest.raises(PredictionTimeout):
        with time_limit(0.3):
            stubborn()
    caught = []

    def in_thread():
        try:
            with time_limit(0.3):
                stubborn()
        except PredictionTimeout as exc:
            caught.append(exc)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(30)
    assert caught and not worker.is_alive()
    with time_limit(5):  # nothing left ringing
        time.sleep(0.1)

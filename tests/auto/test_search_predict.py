"""The search uses predictions: plans predicted over the budget cost no trial, the predicted-fastest
plans that fit run first, and the report shows predicted and measured memory side by side.

The estimator here is a stand-in with the interface of ``composable_atorch.estimate.estimate``
(injected with ``search(..., estimator=)``); the runner is synthetic (these tests are about the
study, not the measurement): its memory and speed follow from the plan's steps.
"""

import json
from dataclasses import dataclass

import pytest
import torch

import composable_atorch as ca
from composable_atorch.auto import report
from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.predict import Prediction, Predictor, predict_plan
from composable_atorch.auto.space import plan_key
from composable_atorch.auto.study import search
from composable_atorch.auto.trial import TrialResult
from composable_atorch.auto.workload import Workload
from composable_atorch.data import TextDataset
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT

from auto_faults import adamw, lm_step

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = pytest.mark.serial

MiB = 2**20
KEPT = ("amp", "checkpoint")
# the GPT's checkpoint options: Block, CausalSelfAttention, MLP fully, Block selectively; with amp or not,
# 2 plans without checkpointing (30 MiB) and 8 with (10-12 MiB)


def workload():
    return Workload(GPT, adamw, TextDataset(16, limit=64), lm_step, 16)


def true_peak(names) -> int:
    return (10 if "checkpoint" in names else 30) * MiB + (2 * MiB if "amp" not in names else 0)


def true_speed(names) -> float:
    return 100.0 - (20 if "checkpoint" in names else 0) + (5 if "amp" in names else 0)


class Runner:
    def __init__(self):
        self.calls = []

    def __call__(self, plan, *, timeout):
        self.calls.append(plan_key(plan))
        return TrialResult(status="ok", samples_per_s=true_speed(plan.names), peak_bytes=true_peak(plan.names))


@dataclass
class Rank:
    peak: int
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    temporary: int = 0


@dataclass
class Est:
    ranks: list
    step_time_s: float | None

    @property
    def peak(self):
        return max(r.peak for r in self.ranks)


class Stub:
    """Predicts ``true_peak x scale`` and the true step time; records what it was given."""

    def __init__(self, scale=1.0, timed=True, fail=False):
        self.scale, self.timed, self.fail, self.calls = scale, timed, fail, []

    def __call__(self, plan, model, batch, *, world_size, device, loss_fn=None, optimizer=None, criterion=None):
        self.calls.append((plan, model, batch, world_size, device, loss_fn, optimizer))
        if self.fail:
            raise RuntimeError("cannot estimate this plan")
        peak = int(true_peak(plan.names) * self.scale)
        return Est([Rank(peak), Rank(peak - 1)], 16 / true_speed(plan.names) if self.timed else None)


def run(memory_limit=None, estimator=None, margin=0.03, n_trials=None, prior=3, **study):
    runner = Runner()
    result = search(
        workload(),
        trial=TrialSettings(world_size=2),
        budget=Budget(n_trials=n_trials, memory_limit=memory_limit, memory_margin=margin),
        space=SpaceOptions(excluded=tuple(sorted(set(ca.registry()) - set(KEPT)))),
        study=StudyOptions(seed=0, preflight=False, prior=prior, **study),
        runner=runner,
        progress=False,
        estimator=estimator,
    )
    return result, runner


def test_plans_predicted_over_the_budget_are_recorded_with_the_prediction_and_never_run(tmp_path):
    stub = Stub()
    result, runner = run(memory_limit="20MiB", estimator=stub)
    valid = result.enumeration.valid
    assert len(valid) == 10 and len(stub.calls) == 10  # every valid plan predicted once
    skipped = result.skipped
    assert len(skipped) == 2 and all("checkpoint" not in r.steps for r in skipped)
    assert all(r.predicted.peak_bytes == true_peak(r.steps) and "predicted peak" in r.reason for r in skipped)
    assert {plan_key(ca.Plan.from_json(r.plan_json, env=result.space.env)) for r in skipped}.isdisjoint(runner.calls)
    assert len(runner.calls) == 8 and result.over_budget_runs == 0  # every run fit: none over the budget
    assert result.stopped_by == "every valid plan measured" and "checkpoint" in result.best.steps
    # the trials table, trials.json and the HTML report show predicted and measured memory side by side
    rows = report.rows(result)
    ran = [r for r in rows if r["status"] == "ok"]
    assert len(ran) == 8 and all(r["predicted_mib"] == r["peak_mib"] for r in ran)
    assert [r["status"] for r in rows[-2:]] == ["predicted-infeasible"] * 2 and all(
        r["peak_mib"] is None for r in rows[-2:]
    )
    written = report.write_all(result, tmp_path)
    data = json.loads(written["trials"].read_text())
    assert data["summary"]["skipped_by_prediction"] == 2 and data["summary"]["runs_over_budget"] == 0
    page = written["report"].read_text()
    assert "predicted MiB" in page and "measured peak MiB" in page
    text = report.text_table(result)
    assert (
        "predicted MiB" in text and "2 predicted over the budget" in text and "0 run(s) over the budget anyway" in text
    )
    # the stub saw a meta-device model, the global batch and the world size
    _, model, batch, world, device, loss_fn, optimizer = stub.calls[0]
    assert (
        next(model.parameters()).is_meta
        and batch[0].shape[0] == 16
        and world == 2
        and device == result.space.env.device
    )
    assert loss_fn is lm_step and optimizer is adamw  # the workload's own loss and optimizer


def test_plans_not_predicted_ahead_are_predicted_when_proposed_and_skipped_at_no_cost():
    stub = Stub()
    result, runner = run(memory_limit="20MiB", estimator=stub, predict_ahead_s=0)
    assert len(result.skipped) == 2 and len(runner.calls) == 8 and result.over_budget_runs == 0
    assert len(stub.calls) == 10 and "0.0 s ahead" in result.prediction_note
    # n_trials beyond what fits: the study stops when every plan is measured or predicted over
    result, runner = run(memory_limit="11MiB", estimator=Stub(), predict_ahead_s=0, n_trials=10)
    assert len(runner.calls) == 4 and len(result.skipped) == 6
    assert result.stopped_by in ("every valid plan measured", "every valid plan measured or predicted over the budget")


def test_the_safety_margin_skips_plans_predicted_just_under_the_budget():
    # amp+checkpoint: 10 MiB; checkpoint: 12 MiB (4 plans each). A 12.2 MiB budget: 12 MiB fits only without margin
    no_margin, runner = run(memory_limit=int(12.2 * MiB), estimator=Stub(), margin=0.0)
    assert len(no_margin.skipped) == 2 and len(runner.calls) == 8
    margin, runner = run(memory_limit=int(12.2 * MiB), estimator=Stub(), margin=0.05)
    assert len(margin.skipped) == 6 and len(runner.calls) == 4
    assert all(r.status == "ok" for r in margin.measured) and margin.over_budget_runs == 0
    with pytest.raises(ConfigError, match="memory_margin"):
        Budget(memory_margin=1.5)


def test_a_low_prediction_costs_a_run_over_the_budget_and_it_is_counted():
    result, runner = run(memory_limit="20MiB", estimator=Stub(scale=0.6), margin=0.0)  # 30 MiB predicted as 18
    assert result.skipped == [] and len(runner.calls) == 10
    assert result.over_budget_runs == 2
    assert "2 run(s) over the budget anyway" in report.text_table(result)


def test_the_first_trials_are_the_plans_predicted_fastest_among_those_that_fit():
    result, runner = run(memory_limit="20MiB", estimator=Stub(), n_trials=3, prior=2, baseline_first=False)
    first = [r for r in result.records if r.status == "ok"][:2]
    # the fitting plans (checkpoint) predicted fastest, one per compute precision: amp + checkpoint (85 samples/s,
    # bf16) then checkpoint alone (80, fp32) -- across dtypes the model errs most, so each dtype's best is measured
    assert {"amp", "checkpoint"} <= set(first[0].steps) and "amp" not in first[1].steps
    assert "checkpoint" in first[1].steps and len({r.plan_label for r in first}) == 2
    assert list(result.prior_labels) == [r.plan_label for r in first]
    assert result.measured_now == 3
    # no memory limit: the prior is the fastest plans overall; the baseline, when asked for, still runs first
    result, _ = run(estimator=Stub(), n_trials=3, prior=2)
    ran = [r for r in result.records if r.status == "ok"]
    assert "amp" not in ran[0].steps and "checkpoint" not in ran[0].steps  # the baseline
    assert set(ran[1].steps) >= {"amp"} and "checkpoint" not in ran[1].steps


def test_without_a_prediction_every_plan_runs_and_the_report_says_why():
    result, runner = run(memory_limit="20MiB", estimator=Stub(fail=True))
    assert result.skipped == [] and len(runner.calls) == 10 and result.over_budget_runs == 2
    assert "cannot estimate this plan" in result.prediction_note
    untimed, _ = run(memory_limit="20MiB", estimator=Stub(timed=False), n_trials=2, baseline_first=False)
    assert untimed.prior_labels == () and len(untimed.skipped) == 2  # memory still used, no prior without a time
    off, runner = run(memory_limit="20MiB", estimator=Stub(), predict=False)
    assert off.skipped == [] and len(runner.calls) == 10 and off.prediction_note.startswith("no predictions")


def test_estimate_plan_reads_the_agreed_interface():
    env = Environment.detect().with_(world_size=2)
    plan = ca.compose(env=env)
    pred = predict_plan(Stub(), plan, None, None, world_size=2, device="cpu")
    assert pred == Prediction(
        true_peak(plan.names), (true_peak(plan.names), true_peak(plan.names) - 1), 16 / true_speed(plan.names)
    )
    assert pred.speed_key == (0, pred.step_time_s) and Prediction(1, flops=7).speed_key == (1, 7.0)
    assert Prediction.from_dict(pred.to_dict()) == pred
    assert pred.over(pred.peak_bytes, 0.01) and not pred.over(pred.peak_bytes, 0.0) and not pred.over(None, 0.5)
    predictor = Predictor(Stub(), workload(), env)
    assert predictor(plan) is predictor(plan) and len(predictor.estimator.calls) == 1  # once per plan
    with torch.device("meta"):
        assert predictor.model().tok.weight.is_meta


def test_pipeline_plans_are_predicted_per_stage_with_the_workloads_criterion():
    """The real estimator on a pipeline plan: the workload's criterion reaches it (a pipeline's
    loss runs inside the schedule), so the plan gets a prediction per stage instead of none."""
    from composable_atorch.auto.workload import GPTTask
    from composable_atorch.estimate import estimate

    env = Environment.detect().with_(world_size=2)
    task = GPTTask(seq_len=32, d_model=32, n_layer=2, n_head=2, batch_size=8)
    plan = ca.compose(ca.mixed_parallel(pipeline=2), env=env)
    pred = Predictor(estimate, task.workload(), env)(plan)
    assert pred.known, pred.reason
    assert len(pred.peak_bytes_per_rank) == 2 and pred.peak_bytes_per_rank[0] != pred.peak_bytes_per_rank[1]
    assert pred.peak_bytes == max(pred.peak_bytes_per_rank)
    without = Workload(task.model, task.optimizer, task.dataset(), task.loss, task.batch_size)  # no criterion
    assert "criterion" in Predictor(estimate, without, env)(plan).reason


def test_a_prediction_that_hangs_is_abandoned_and_the_plan_measured_instead():
    import time

    from composable_atorch.auto.predict import PredictionTimeout, time_limit

    started = time.monotonic()
    with pytest.raises(PredictionTimeout):
        with time_limit(0.5):
            time.sleep(30)  # a user forward that hangs for some plan
    assert time.monotonic() - started < 5
    with time_limit(5):  # no alarm left behind
        time.sleep(0.1)


class SlowBaseline(Stub):
    """The plan of no request (fp32, no checkpoint) predicted at half the speed of the others."""

    def __call__(self, plan, *args, **kwargs):
        est = super().__call__(plan, *args, **kwargs)
        if not {"amp", "checkpoint"} & set(plan.names):
            est.step_time_s *= 2
        return est


def test_a_baseline_predicted_to_lose_is_not_run_and_the_table_says_why_in_full():
    result, runner = run(estimator=SlowBaseline(), n_trials=3, prior=2)
    slower = [r for r in result.records if r.status == "predicted-slower"]
    assert len(slower) == 1 and slower[0].reason.startswith("the baseline: predicted")
    assert not {"amp", "checkpoint"} & set(slower[0].steps)
    ran = [r for r in result.records if r.status == "ok"]
    assert ran and all({"amp", "checkpoint"} & set(r.steps) for r in ran)  # no trial on the baseline
    text = report.text_table(result)
    assert slower[0].reason in text  # whole, not cut at a column width
    row = next(r for r in report.rows(result) if r["status"] == "ok")
    assert row["predicted_step_s"] is not None and "predicted s" in text


def test_a_failure_reason_with_brackets_is_printed_as_text(capsys):
    """gloo's messages hold "[/path/pair.cc:553]": printed as rich markup they raised MarkupError and
    stopped the whole search."""

    def runner(plan, *, timeout):
        return TrialResult(status="failed", reason="RuntimeError: [/gloo/tcp/pair.cc:553] Connection closed by peer")

    result = search(
        workload(),
        trial=TrialSettings(world_size=2),
        budget=Budget(n_trials=2),
        space=SpaceOptions(excluded=tuple(sorted(set(ca.registry()) - set(KEPT)))),
        study=StudyOptions(seed=0, preflight=False, predict=False),
        runner=runner,
        progress=True,
    )
    assert len(result.measured) == 2 and all(r.status == "failed" for r in result.measured)
    assert "[/gloo/tcp/pair.cc:553]" in capsys.readouterr().out


def test_predicting_an_fsdp_plan_prints_no_fsdp_view_warning_into_the_users_log():
    """Issue 30: the demo's log showed torch's FSDP2 "returned a view tensor" UserWarning twice, from the
    predictions simulating fsdp plans in the searching process (nn.Linear's 3-D output is a view). The
    predictor silences that one warning; the same estimate called directly still raises it."""
    import warnings

    from composable_atorch.auto.workload import GPTTask
    from composable_atorch.estimate import estimate
    from composable_atorch.models.gpt import CausalSelfAttention

    env = Environment.detect().with_(world_size=2)
    task = GPTTask(seq_len=32, d_model=32, n_layer=2, n_head=2, batch_size=8)
    plan = ca.compose(ca.fsdp(wrap=(CausalSelfAttention,)), env=env)
    view = "returned a view tensor"
    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        estimate(plan, task.model, Predictor(estimate, task.workload(), env).batch(), world_size=2, device="cpu")
    assert any(view in str(w.message) for w in direct)  # what the user's log got
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pred = Predictor(estimate, task.workload(), env)(plan)
    assert pred.known, pred.reason
    assert not [w for w in seen if view in str(w.message)]


def test_the_trials_table_in_a_log_keeps_every_plan_whole_on_its_own_line():
    """Issue 30: piped into a file, rich folded each plan into a column ~20 characters wide (about a
    hundred lines for eight trials). Not on a terminal, the table is plain text: one line of figures per
    trial, then the whole plan and the whole reason on lines of their own."""
    import io

    from rich.console import Console

    result, _ = run(memory_limit="20MiB", estimator=Stub(), n_trials=4)
    log = io.StringIO()
    report.show(Console(file=log, force_terminal=False, width=80), result)
    text = log.getvalue()
    lines = text.splitlines()
    for row in report.rows(result):
        assert f"      plan: {row['plan']}" in lines  # whole, on one line, however wide the console
        if row["reason"]:
            assert f"      reason: {row['reason']}" in lines
    assert "┃" not in text and max(len(line) for line in lines) > 80  # not a rich table, not wrapped at 80
    assert len(lines) <= 2 + 3 * len(report.rows(result))
    terminal = io.StringIO()
    report.show(Console(file=terminal, force_terminal=True, width=200), result)
    assert "┃" in terminal.getvalue()  # a terminal still gets rich's table


def test_the_table_orders_skipped_plans_whose_prediction_has_no_memory_figure():
    """A plan skipped as predicted slower can carry a step time and no peak (the README demo crashed
    sorting such a record against one with a peak: None < int)."""
    stub = Stub()
    result, _ = run(memory_limit="20MiB", estimator=stub)
    first = result.skipped[0]
    first.predicted = Prediction(step_time_s=1.0)
    first.status = "predicted-slower"
    rows = report.rows(result)
    assert {r["status"] for r in rows[-2:]} == {"predicted-slower", "predicted-infeasible"}
    assert any(r["predicted_mib"] is None for r in rows[-2:])
    assert "predicted-slower" in report.text_table(result)

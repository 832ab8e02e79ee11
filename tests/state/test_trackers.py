"""init_trackers: jsonl and tensorboard built in, hosted trackers through their own clients, rank 0 only."""

from __future__ import annotations

import json
import sys
import types

import pytest

import composable_atorch as ca
from composable_atorch.errors import ConfigError, RequirementError
from composable_atorch.models import Block
from composable_atorch.state import trackers
from composable_atorch.state.trackers import init_trackers


@pytest.fixture
def plan():
    return ca.compose(ca.checkpoint(Block), ca.clip_grad(1.0))


def test_jsonl_logs_config_plan_then_metrics(tmp_path, plan):
    import torch

    with init_trackers(
        "exp", log_with="jsonl", project_dir=tmp_path, config={"lr": 3e-4, "opt": {"betas": [0.9, 0.95]}}, plan=plan
    ) as t:
        t.log({"loss": torch.tensor(2.5)}, step=1)
        t.log({"loss": 2.0, "lr": 1e-4}, step=2)
    lines = [json.loads(x) for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "config" and lines[0]["config"]["lr"] == 3e-4
    assert ca.Plan.from_json(json.dumps(lines[0]["plan"])) == plan
    assert [(r["step"], r["loss"]) for r in lines[1:]] == [(1, 2.5), (2, 2.0)]


def test_tensorboard_writes_scalars_and_the_plan(tmp_path, plan):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = init_trackers("tb", log_with=["tensorboard"], project_dir=tmp_path, config={"lr": 0.1, "steps": 3}, plan=plan)
    for step, loss in enumerate([3.0, 2.0, 1.0]):
        t.log({"loss": loss}, step=step)
    t.finish()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    texts = {
        tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
        if tag.startswith("plan")
    }
    assert texts and ca.Plan.from_json(next(iter(texts.values()))) == plan


def test_wandb_goes_through_its_client(tmp_path, monkeypatch, plan):
    calls = []

    class Run:
        config = types.SimpleNamespace(update=lambda d, allow_val_change: calls.append(("config", d)))

        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    t = init_trackers(
        "proj",
        log_with="wandb",
        project_dir=tmp_path,
        config={"lr": 1},
        plan=plan,
        init_kwargs={"wandb": {"entity": "me"}},
    )
    t.log({"loss": 1.5}, step=4)
    t.finish()
    assert calls[0] == ("init", {"project": "proj", "dir": str(tmp_path), "config": {"lr": 1}, "entity": "me"})
    assert calls[1][0] == "config" and ca.Plan.from_json(json.dumps(calls[1][1]["plan"])) == plan
    assert calls[2:] == [("log", {"loss": 1.5}, 4), ("finish",)]


def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    with pytest.raises(RequirementError, match=r"composable_atorch\[track\]"):
        init_trackers(log_with=["jsonl", "mlflow"], project_dir=tmp_path)
    assert not (tmp_path / "run").exists()  # checked before anything is written


def test_unknown_tracker_and_stray_kwargs_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="tensorbord"):
        init_trackers(log_with="tensorbord", project_dir=tmp_path)
    with pytest.raises(ConfigError, match="init_kwargs"):
        init_trackers(log_with="jsonl", project_dir=tmp_path, init_kwargs={"wandb": {}})


def test_only_rank_zero_logs(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "_rank", lambda: 1)
    t = init_trackers(log_with="jsonl", project_dir=tmp_path, config={"a": 1})
    t.log({"loss": 1.0}, step=0)
    t.finish()
    assert not (tmp_path / "run").exists()

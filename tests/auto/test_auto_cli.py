"""The search CLI and the demo hand their flags to search() as policies (no trial runs here)."""

import pytest

from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.workload import Workload
from composable_atorch.cli import demo
from composable_atorch.cli import search as cli_search
from composable_atorch.errors import WorkloadError


class Stop(Exception):
    pass


def capture(monkeypatch, module):
    seen = {}

    def fake(workload, **kwargs):
        seen.update(kwargs, workload=workload)
        raise Stop

    monkeypatch.setattr(module, "search", fake)
    return seen


def test_search_cli_flags_become_policies(monkeypatch, tmp_path):
    seen = capture(monkeypatch, cli_search)
    with pytest.raises(Stop):
        cli_search.main(
            [
                "--world-size",
                "2",
                "--trials",
                "3",
                "--time-limit",
                "40",
                "--memory-limit",
                "40MiB",
                "--exclude",
                "fp8,compile",
                "--include",
                "amp",
                "--storage",
                str(tmp_path / "s.db"),
                "--study-name",
                "x",
                "--seed",
                "7",
                "--sampler",
                "random",
                "--trial-timeout",
                "33",
                "--memory-margin",
                "0.1",
            ]
        )
    assert isinstance(seen["workload"], Workload) and seen["workload"].batch_size == 16
    assert seen["trial"] == TrialSettings(world_size=2, measure_steps=5, timeout=33.0)
    assert seen["budget"] == Budget(n_trials=3, time_limit=40.0, memory_limit="40MiB", memory_margin=0.1)
    assert seen["space"] == SpaceOptions(excluded=("fp8", "compile"), included=("amp",))
    assert seen["study"] == StudyOptions(storage=str(tmp_path / "s.db"), study_name="x", seed=7, sampler="random")


def test_demo_flags_become_policies(monkeypatch, tmp_path):
    seen = capture(monkeypatch, demo)
    with pytest.raises(Stop):
        demo.main(["--out", str(tmp_path), "--trials", "4", "--time-limit", "50", "--memory-limit", "48MiB"])
    assert seen["trial"].world_size == 2 and seen["budget"] == Budget(n_trials=4, time_limit=50.0, memory_limit="48MiB")
    assert seen["space"].excluded == demo.DEMO_EXCLUDED and seen["workload"].batch_size == demo.TASK.batch_size


def test_search_cli_reports_a_workload_error_and_exits_2(monkeypatch, capsys):
    def fake(workload, **kwargs):
        raise WorkloadError("loss_fn(model, batch)", TypeError("bad"), "set model_input_format")

    monkeypatch.setattr(cli_search, "search", fake)
    assert cli_search.main(["--trials", "1"]) == 2
    assert "model_input_format" in capsys.readouterr().err

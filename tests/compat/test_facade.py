"""The seed's auto_accelerate: both modes under torchrun, the seed's argument forms, typed errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

import composable_atorch as ca
from composable_atorch import strategy
from composable_atorch.errors import ConfigError, UnknownTransformError
from composable_atorch.models import Block

HERE = os.path.dirname(os.path.dirname(__file__))  # tests/: its scripts and helpers
sys.path.insert(0, os.path.join(HERE, "scripts"))
import seed_task  # noqa: E402

COMMON = dict(
    optim_func=torch.optim.AdamW,
    dataset=seed_task.DictText(),
    loss_func=seed_task.loss_func,
    model_input_format="unpack_dict",
    optim_args={"lr": 3e-3},
    dataloader_args={"batch_size": 8, "shuffle": True},
)


def train(result, steps):
    losses, data = [], iter(result.dataloader)
    for _ in range(steps):
        try:
            batch = next(data)
        except StopIteration:
            data = iter(result.dataloader)
            batch = next(data)
        batch = result.prepare_input(batch, "cpu")
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.backward(loss)
        result.optim.step()
        result.optim.zero_grad()
        if result.lr_scheduler is not None:
            result.lr_scheduler.step()
        losses.append(loss.item())
    return losses


def test_unknown_karg_and_bad_inputs_are_config_errors_before_any_work():
    model = seed_task.build()
    with pytest.raises(ConfigError, match="auto_accelerate keyword 'verbos'"):
        ca.auto_accelerate(model, load_strategy=["amp_native"], verbos=True, **COMMON)
    with pytest.raises(ConfigError, match="model_input_format"):
        ca.auto_accelerate(model, load_strategy=["amp_native"], **{**COMMON, "model_input_format": "kwargs"})
    with pytest.raises(ConfigError, match="optim_func"):
        ca.auto_accelerate(model, dataset=COMMON["dataset"], loss_func=seed_task.loss_func)  # automatic mode needs it
    with pytest.raises(UnknownTransformError, match="amp_native"):
        ca.auto_accelerate(model, load_strategy=["amp_nativ"], **COMMON)


def test_semi_automatic_in_one_process_trains_and_round_trips_the_strategy(tmp_path):
    path = tmp_path / "plan.json"
    status, result, best = ca.auto_accelerate(
        seed_task.build(),
        load_strategy=[
            ("amp_native", {"dtype": torch.bfloat16}),
            ("checkpoint", (Block,)),
            ("accumulate", {"steps": 2}),
        ],
        save_strategy_to_file=str(path),
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
        lr_scheduler_args={"step_size": 100},
        **COMMON,
    )
    assert status is True
    assert best.names == ("checkpoint", "amp", "accumulate")
    assert result.args.use_optim_backward is True  # accumulation scales the loss in optim.backward
    assert result.args.requires_set_gradient_accumulation_boundary is False
    assert isinstance(result.lr_scheduler, torch.optim.lr_scheduler.StepLR)
    assert result.dataloader.batch_size == 4  # micro-batches of the global 8
    losses = train(result, 40)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert strategy.load(str(path)) == best  # JSON written, read back to an equal plan
    assert json.loads(path.read_text())["format"] == "composable_atorch.plan"
    # the returned strategy is reusable as load_strategy
    status, _, again = ca.auto_accelerate(seed_task.build(), load_strategy=best, **COMMON)
    assert status and again == best


@pytest.mark.dist
def test_both_modes_under_torchrun_agree_on_one_plan_and_train(tmp_path):
    script = os.path.join(HERE, "scripts", "facade_torchrun.py")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "scripts"), HERE, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("semi", "auto"):
        a, b = ranks[0][mode], ranks[1][mode]
        assert a["status"] is True and b["status"] is True
        assert a["plan"] == b["plan"]  # every rank got rank 0's decision
        assert a["checksum"] == pytest.approx(b["checksum"], rel=1e-6)  # trained together: replicas agree
        assert a["losses"][-1] < a["losses"][0]
        saved = strategy.load(str(tmp_path / f"{mode}.json"), env=ca.Environment.detect().with_(world_size=2))
        assert saved == ca.Plan.from_json(a["plan"], env=ca.Environment.detect().with_(world_size=2))
    semi_steps = json.loads(ranks[0]["semi"]["plan"])["steps"]
    assert "ddp" in semi_steps and "amp" in semi_steps  # parallel_mode implies ddp, as the seed's parallel_mode means


def test_dry_run_on_load_strategy_reports_success_and_failure():
    kwargs = {**COMMON, "trial_timeout": 120}
    status, result, best = ca.auto_accelerate(
        seed_task.build(),
        load_strategy=[("amp_native", {"dtype": torch.bfloat16})],
        ignore_dryrun_on_load_strategy=False,
        **kwargs,
    )
    assert status is True and best.names == ("amp",)
    status, result, best = ca.auto_accelerate(
        seed_task.build(),
        load_strategy=["amp_native"],
        ignore_dryrun_on_load_strategy=False,
        **{**kwargs, "loss_func": seed_task.broken_loss_func},
    )
    assert (status, result, best) == (False, None, None)


def test_finetune_strategy_measures_the_loaded_plan_first_and_returns_a_measured_plan(tmp_path):
    loaded = ca.compose(ca.amp("bf16"), ca.checkpoint(Block))
    path = tmp_path / "tuned.json"
    status, result, best = ca.auto_accelerate(
        seed_task.build(),
        load_strategy=loaded,
        finetune_strategy=True,
        n_trials=2,
        trial_timeout=120,
        predict_ahead_s=0,  # which plans ran, in what order, is asserted: not the predictions' prior
        storage=str(tmp_path / "study.db"),
        study_name="finetune",
        save_strategy_to_file=str(path),
        **COMMON,
    )
    assert status is True
    import optuna

    study = optuna.load_study(study_name="finetune", storage=f"sqlite:///{tmp_path / 'study.db'}")
    measured = [t for t in study.trials if t.user_attrs.get("plan_json")]
    assert len(measured) == 2
    assert ca.Plan.from_json(measured[0].user_attrs["plan_json"]) == loaded  # the loaded plan runs first
    assert best in [ca.Plan.from_json(t.user_attrs["plan_json"]) for t in measured]
    assert strategy.load(str(path)) == best
    losses = train(result, 30)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5

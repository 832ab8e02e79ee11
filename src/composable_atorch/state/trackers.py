"""Experiment trackers (Accelerate's "Logging" guide), through each tracker's own client.

    tracking = init_trackers("runs", log_with=["tensorboard", "jsonl"], project_dir="out",
                             config={"lr": 3e-4}, plan=plan)      # VI.A + VI.B
    tracking.log({"loss": loss.item()}, step=step)                 # VI.D
    tracking.finish()                                              # VI.C

Built in: ``"jsonl"`` (one JSON object a line in ``project_dir/project_name/metrics.jsonl``, no
package needed) and ``"tensorboard"`` (torch's SummaryWriter; ``pip install
"composable_atorch[track]"``). Hosted trackers, one small adapter each, used when their package is
installed: ``"wandb"``, ``"mlflow"``, ``"aim"``, ``"comet_ml"``. ``"all"`` means every tracker
whose package imports. A named tracker whose package is missing raises RequirementError naming the
extra, before anything is written.

Only rank 0 logs (other ranks get a tracker that does nothing), so a loop calls the same lines
on every rank. At start the hyper-parameters (``config``) and the plan's JSON are logged.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from composable_atorch.errors import ConfigError, RequirementError

__all__ = ["TRACKERS", "Tracker", "Tracking", "init_trackers"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested hyper-parameters as ``a.b`` keys with scalar values (what tensorboard/mlflow take)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, bool | int | float | str) or v is None:
            out[key] = v
        else:
            out[key] = str(v)
    return out


class Tracker:
    """One tracker. ``module`` names its package (checked before it is made); methods are no-ops."""

    name = "tracker"
    module: str | None = None

    def __init__(self, project_name: str, project_dir: Path, **kwargs):
        self.project_name, self.project_dir, self.kwargs = project_name, project_dir, kwargs

    def start(self, config: dict[str, Any], plan_json: str | None) -> None:
        pass

    def log(self, values: dict[str, float], step: int | None) -> None:
        pass

    def finish(self) -> None:
        pass


class JsonLinesTracker(Tracker):
    """``metrics.jsonl``: a ``{"kind": "config", ...}`` line, then ``{"step": s, "loss": ...}`` lines."""

    name = "jsonl"

    def start(self, config, plan_json):
        self.path = self.project_dir / self.project_name / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        plan = None if plan_json is None else json.loads(plan_json)
        self._write({"kind": "config", "time": time.time(), "config": config, "plan": plan})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def log(self, values, step):
        self._write({"kind": "metrics", "time": time.time(), "step": step, **values})

    def finish(self):
        self._file.close()


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    module = "tensorboard"

    def start(self, config, plan_json):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.project_dir / self.project_name), **self.kwargs)
        self.writer.add_text("config", json.dumps(config, default=str, indent=1))
        if plan_json is not None:
            self.writer.add_text("plan", plan_json)
        scalars = {k: v for k, v in _flat(config).items() if isinstance(v, int | float | str | bool)}
        if scalars:
            self.writer.add_hparams(scalars, {}, run_name=".")
        self.writer.flush()

    def log(self, values, step):
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def finish(self):
        self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"
    module = "wandb"

    def start(self, config, plan_json):
        import wandb

        self.run = wandb.init(project=self.project_name, dir=str(self.project_dir), config=config, **self.kwargs)
        if plan_json is not None:
            self.run.config.update({"plan": json.loads(plan_json)}, allow_val_change=True)

    def log(self, values, step):
        self.run.log(values, step=step)

    def finish(self):
        self.run.finish()


class MLflowTracker(Tracker):
    name = "mlflow"
    module = "mlflow"

    def start(self, config, plan_json):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(self.project_name)
        self.run = mlflow.start_run(**self.kwargs)
        flat = _flat(config)
        if flat:
            mlflow.log_params(flat)
        if plan_json is not None:
            mlflow.log_text(plan_json, "plan.json")

    def log(self, values, step):
        self.mlflow.log_metrics(values, step=step)

    def finish(self):
        self.mlflow.end_run()


class AimTracker(Tracker):
    name = "aim"
    module = "aim"

    def start(self, config, plan_json):
        import aim

        self.run = aim.Run(repo=str(self.project_dir), experiment=self.project_name, **self.kwargs)
        self.run["hparams"] = config
        if plan_json is not None:
            self.run["plan"] = json.loads(plan_json)

    def log(self, values, step):
        for k, v in values.items():
            self.run.track(v, name=k, step=step)

    def finish(self):
        self.run.close()


class CometTracker(Tracker):
    name = "comet_ml"
    module = "comet_ml"

    def start(self, config, plan_json):
        import comet_ml

        self.experiment = comet_ml.start(project_name=self.project_name, **self.kwargs)
        self.experiment.log_parameters(_flat(config))
        if plan_json is not None:
            self.experiment.log_text(plan_json, metadata={"name": "plan.json"})

    def log(self, values, step):
        self.experiment.log_metrics(values, step=step)

    def finish(self):
        self.experiment.end()


#: name -> adapter class; add yours with ``TRACKERS["name"] = MyTracker``.
TRACKERS: dict[str, type[Tracker]] = {
    t.name: t for t in (JsonLinesTracker, TensorBoardTracker, WandbTracker, MLflowTracker, AimTracker, CometTracker)
}


def _importable(module: str | None) -> bool:
    if module is None:
        return True
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


class Tracking:
    """The trackers of one run; on ranks other than 0 it holds none and every call does nothing."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Log scalar ``values`` (tensors are turned into floats) at ``step``."""
        if not self.trackers:
            return
        clean = {k: float(v.item() if hasattr(v, "item") else v) for k, v in values.items()}
        for t in self.trackers:
            t.log(clean, step)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()
        self.trackers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()


def init_trackers(
    project_name: str = "run",
    *,
    log_with: str | list[str] = "jsonl",
    project_dir: str | os.PathLike = ".",
    config: dict[str, Any] | None = None,
    plan=None,
    init_kwargs: dict[str, dict[str, Any]] | None = None,
) -> Tracking:
    """Start the trackers named in ``log_with`` (see the module doc) and log ``config`` and ``plan``.

    ``plan`` is a Plan (its ``to_json()`` is logged) or JSON text. ``init_kwargs`` maps a tracker
    name to extra keywords for its client (``{"wandb": {"entity": "me"}}``).
    """
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    if names == ["all"]:
        names = [n for n, cls in TRACKERS.items() if _importable(cls.module)]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError("log_with", unknown[0], f"one of {sorted(TRACKERS)} or 'all'")
    init_kwargs = dict(init_kwargs or {})
    bad = sorted(set(init_kwargs) - set(names))
    if bad:
        raise ConfigError("init_kwargs", bad[0], f"a tracker named in log_with {names}")
    for n in names:
        if not _importable(TRACKERS[n].module):
            raise RequirementError(
                f"log_with={n!r}",
                f"the {TRACKERS[n].module} package",
                f'pip install "composable_atorch[track]" (or pip install {TRACKERS[n].module})',
            )
    if config is not None and not isinstance(config, dict):
        raise ConfigError("config", type(config).__name__, "a dict of hyper-parameters, or None")
    plan_json = plan if isinstance(plan, str) or plan is None else plan.to_json()
    if _rank() != 0:
        return Tracking([])
    trackers = [TRACKERS[n](project_name, Path(project_dir), **init_kwargs.get(n, {})) for n in names]
    for t in trackers:
        t.start(dict(config or {}), plan_json)
    return Tracking(trackers)

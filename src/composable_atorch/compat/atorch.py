"""The seed's ``auto_accelerate``: a thin facade over strategies, the search and plans.

``load_strategy`` given -> semi-automatic: the strategy is loaded (any form strategy.load takes),
checked by compose() and applied; with ``ignore_dryrun_on_load_strategy=False`` it is first run
once in fresh processes and a failure returns ``status False``. ``finetune_strategy=True`` measures
it first and then searches around it. Without ``load_strategy`` -> fully automatic: the optuna
search (:func:`composable_atorch.auto.search`) picks the plan.

Under torchrun every rank calls this. Rank 0 decides the plan (loads it, or searches in fresh
worker processes at this world size) and broadcasts the plan as JSON text; every rank composes
it again against its own process and applies it. Errors the caller can fix are raised on every
rank before any work.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections import namedtuple
from typing import Any

import torch

from composable_atorch.core import strategy
from composable_atorch.core.compose import compose
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError, ConfigError
from composable_atorch.runtime.optim import OptimizerHook

AccelerateResult = namedtuple("AccelerateResult", ["model", "optim", "dataloader", "loss_func", "prepare_input", "args", "lr_scheduler"])
AccelerateArgs = namedtuple("AccelerateArgs", ["use_optim_backward", "requires_set_gradient_accumulation_boundary"])

#: kargs and their defaults: the seed's four, then the search budget (not in the seed).
KARGS: dict[str, Any] = {
    "verbose": False,
    "time_limit": None,
    "find_unused_parameters": None,
    "ignore_dryrun_on_load_strategy": True,
    "n_trials": None,  # plans to measure in fully automatic mode; default 12 when there is no time_limit
    "memory_limit": None,  # peak bytes per rank (or "300MiB"); over-budget plans are infeasible
    "storage": None,  # sqlite path / optuna URL to persist and resume the study
    "study_name": None,
    "seed": 0,
    "trial_timeout": 120.0,
}
MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")


def default_prepare_input(data, device):
    """The seed's default: move the batch (tensors inside tuples, lists and dicts) to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {k: default_prepare_input(v, device) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return type(data)(default_prepare_input(v, device) for v in data)
    return data


@dataclasses.dataclass(frozen=True)
class SeedLoss:
    """The seed's loop as a picklable ``loss_fn(model, batch)`` for the search's workers."""

    loss_func: Any
    prepare_input: Any = None
    model_input_format: str | None = None

    def __call__(self, model, batch):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        data = (self.prepare_input or default_prepare_input)(batch, device)
        if self.model_input_format == "unpack_sequence":
            output = model(*data)
        elif self.model_input_format == "unpack_dict":
            output = model(**data)
        else:
            output = model(data)
        loss = self.loss_func(data, output)
        return loss[0] if isinstance(loss, list | tuple) else loss


@dataclasses.dataclass(frozen=True)
class SeedOptimizer:
    """``optim_func(params, **optim_args)`` with params from ``optim_param_func(model)`` if given."""

    optim_func: Any
    optim_args: dict | None = None
    optim_param_func: Any = None

    def __call__(self, model):
        params = self.optim_param_func(model) if self.optim_param_func else model.parameters()
        return self.optim_func(params, **(self.optim_args or {}))


@dataclasses.dataclass(frozen=True)
class ModelCopy:
    """A fresh copy of the user's model for each trial (the instance travels to the workers)."""

    model: torch.nn.Module

    def __call__(self):
        return copy.deepcopy(self.model)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Plan settings the seed passes outside the strategy, set on whichever transform has the field."""

    find_unused_parameters: bool | None = None
    distributed_sampler_cls: type | None = None

    def __call__(self, plan: Plan) -> Plan:
        changes = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if not changes:
            return plan
        steps = []
        for t in plan.transforms:  # implied steps too: the sampler lives on an implied parallel_mode
            fields = {f.name for f in dataclasses.fields(t)}
            mine = {k: v for k, v in changes.items() if k in fields}
            steps.append(dataclasses.replace(t, **mine) if mine else t)
        return compose(*steps, env=plan.env, strict=plan.strict)


def _check(model, optim_func, dataset, loss_func, model_input_format, excluded, included, load_strategy, lr_scheduler_cls, kargs):
    unknown = sorted(set(kargs) - set(KARGS))
    if unknown:
        raise ConfigError(f"auto_accelerate keyword {unknown[0]!r}", kargs[unknown[0]], f"one of {sorted(KARGS)}")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    if model_input_format not in MODEL_INPUT_FORMATS:
        raise ConfigError("model_input_format", model_input_format, "None, 'unpack_sequence' or 'unpack_dict'")
    for name, value in (("excluded", excluded), ("included", included)):
        if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
            raise ConfigError(name, value, "a list of optimization method names")
    if optim_func is not None and not callable(optim_func):
        raise ConfigError("optim_func", optim_func, "an optimizer class or a function (parameters, **optim_args) -> optimizer")
    if lr_scheduler_cls is not None and optim_func is None:
        raise ConfigError("lr_scheduler_cls", lr_scheduler_cls, "None when there is no optim_func (a scheduler needs an optimizer)")
    if load_strategy is None:
        missing = [n for n, v in (("optim_func", optim_func), ("dataset", dataset), ("loss_func", loss_func)) if v is None]
        if missing:
            raise ConfigError(missing[0], None, "given: fully automatic mode (no load_strategy) measures training steps, so it needs optim_func, dataset and loss_func")


def _ensure_process_group(env_world: int) -> None:
    import torch.distributed as dist

    if env_world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(text: str | None) -> str:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)  # a JSON string: no object of ours is pickled
    return box[0]


def auto_accelerate(
    model,
    optim_func=None,
    dataset=None,
    loss_func=None,
    prepare_input=None,
    model_input_format=None,
    optim_args=None,
    optim_param_func=None,
    dataloader_args=None,
    distributed_sampler_cls=None,
    excluded=None,
    included=None,
    load_strategy=None,
    lr_scheduler_cls=None,
    lr_scheduler_args=None,
    finetune_strategy=False,
    save_strategy_to_file=None,
    **kargs,
):
    """Returns ``(status, result, best_strategy)`` as ATorch's auto_accelerate does (see the module doc).

    ``result`` is ``AccelerateResult(model, optim, dataloader, loss_func, prepare_input, args,
    lr_scheduler)``; ``best_strategy`` is the Plan (reusable as ``load_strategy``), saved as JSON
    to ``save_strategy_to_file`` when given (never pickle).
    """
    _check(model, optim_func, dataset, loss_func, model_input_format, excluded, included, load_strategy, lr_scheduler_cls, kargs)
    opts = {**KARGS, **kargs}
    env = Environment.detect()
    _ensure_process_group(env.world_size)
    settings = Settings(opts["find_unused_parameters"], distributed_sampler_cls)
    loaded = None if load_strategy is None else settings(strategy.load(load_strategy, env=env))  # typed errors on every rank
    dataloader_args = dict(dataloader_args or {})
    optim_maker = None if optim_func is None else SeedOptimizer(optim_func, optim_args, optim_param_func)

    text, failure = None, None
    if _rank() == 0:
        try:
            if loaded is not None and not finetune_strategy:
                text = loaded.to_json()
                if not opts["ignore_dryrun_on_load_strategy"]:
                    failure = _dry_run(loaded, model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args, opts)
            else:
                text, failure = _search(model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args,
                                        excluded, included, loaded, settings, env, opts)
        except CompositionError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        payload = json.dumps({"plan": None if failure else text, "failure": failure})
    else:
        payload = None
    decided = json.loads(_broadcast(payload))
    if decided["failure"]:
        if opts["verbose"] and _rank() == 0:
            print(f"auto_accelerate: no plan: {decided['failure']}")
        return False, None, None
    plan = Plan.from_json(decided["plan"], env=env)
    if save_strategy_to_file and _rank() == 0:
        strategy.dump(plan, save_strategy_to_file)
    optim = optim_maker(model) if optim_maker else None
    loader = None
    if dataset is not None:
        loader = torch.utils.data.DataLoader(dataset, **dataloader_args)
    model, optim, loader = plan(model, optim, loader)
    if opts["verbose"] and _rank() == 0:
        print(plan.explain())
    scheduler = None
    if lr_scheduler_cls is not None:
        scheduler = lr_scheduler_cls(optim, **(lr_scheduler_args or {}))
    args = AccelerateArgs(use_optim_backward=_needs_optim_backward(optim), requires_set_gradient_accumulation_boundary=_needs_boundary(optim))
    result = AccelerateResult(model, optim, loader, loss_func, prepare_input or default_prepare_input, args, scheduler)
    return True, result, plan


def _needs_optim_backward(optim) -> bool:
    """True when a hook changes the backward pass (loss scaling, accumulation, skipped sync...)."""
    base = OptimizerHook
    hooks = getattr(optim, "hooks", ())
    return any(
        type(h).scale_loss is not base.scale_loss or type(h).backward is not base.backward
        or type(h).backward_context is not base.backward_context
        for h in hooks
    )


def _needs_boundary(optim) -> bool:
    """The returned optimizer counts micro-batches itself; only a hook that says so needs the calls."""
    return any(getattr(h, "requires_boundary_calls", False) for h in getattr(optim, "hooks", ()))


def _workload(model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args):
    from composable_atorch.auto.worker import Workload

    batch_size = dataloader_args.get("batch_size", 1)
    loader_kwargs = {k: v for k, v in dataloader_args.items() if k not in ("batch_size", "sampler", "batch_sampler")}
    loader_kwargs.setdefault("shuffle", False)
    loader_kwargs.setdefault("drop_last", False)
    return Workload(ModelCopy(model), optim_maker, dataset, SeedLoss(loss_func, prepare_input, model_input_format), batch_size, loader_kwargs)


def _dry_run(plan, model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args, opts) -> str | None:
    from composable_atorch.auto.trial import TrialSettings, check_picklable, run_trial

    if optim_maker is None or dataset is None or loss_func is None:
        raise ConfigError("ignore_dryrun_on_load_strategy", False, "True unless optim_func, dataset and loss_func are given (a dry run trains)")
    workload = _workload(model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args)
    check_picklable(workload)
    world = int(os.environ.get("WORLD_SIZE", plan.env.world_size))
    result = run_trial(plan.to_json(), workload, TrialSettings(world_size=world, timeout=opts["trial_timeout"], measure_memory=False))
    if opts["verbose"]:
        print(f"auto_accelerate: dry run {result.status}" + (f": {result.reason}" if result.reason else f", {result.samples_per_s:.1f} samples/s"))
    return None if result.ok else f"dry run failed: {result.reason}"


def _search(model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args,
            excluded, included, loaded, settings, env, opts) -> tuple[str | None, str | None]:
    from composable_atorch.auto import report
    from composable_atorch.auto.study import search

    workload = _workload(model, optim_maker, dataset, loss_func, prepare_input, model_input_format, dataloader_args)
    n_trials = opts["n_trials"] if opts["n_trials"] is not None or opts["time_limit"] is not None else 12
    result = search(
        workload.model_fn, workload.optim_fn, workload.dataset, workload.loss_fn, world_size=env.world_size,
        batch_size=workload.batch_size, loader_kwargs=workload.loader_kwargs, n_trials=n_trials,
        time_limit=opts["time_limit"], memory_limit=opts["memory_limit"], excluded=tuple(excluded or ()),
        included=tuple(included or ()), storage=opts["storage"], study_name=opts["study_name"], seed=opts["seed"],
        start_from=loaded, customize=settings, trial_timeout=opts["trial_timeout"], progress=bool(opts["verbose"]), env=env,
    )
    if opts["verbose"]:
        print(report.text_table(result))
    if result.best_plan is None:
        return None, f"no plan trained within the budget ({len(result.measured)} measured; stopped by {result.stopped_by})"
    return result.best_plan.to_json(), None

"""What an ``auto_accelerate`` call asks for, checked once: the frozen :class:`Request` and its parts.

ATorch's arguments (``optim_func``, ``loss_func``, ``model_input_format``, ``sample_batch``...) in
the shapes the rest of the facade needs: picklable callables for worker processes, the
``result.args`` mapping, and the sample-batch dataset. :mod:`.atorch` decides and applies the plan.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import torch

from composable_atorch.core.compose import compose
from composable_atorch.core.plan import Plan
from composable_atorch.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)  # Mapping's equality: equal to the dict ATorch returns
class AccelerateArgs(Mapping):
    """``result.args``: read as ``args.use_optim_backward`` or, as ATorch's dict, ``args["use_optim_backward"]``."""

    use_optim_backward: bool = False
    requires_set_gradient_accumulation_boundary: bool = False

    def __getitem__(self, key):
        if key not in self.__dataclass_fields__:
            raise KeyError(f"{key!r}: result.args has {sorted(self.__dataclass_fields__)}")
        return getattr(self, key)

    def __iter__(self):
        return iter(self.__dataclass_fields__)

    def __len__(self):
        return len(self.__dataclass_fields__)


#: kargs and their defaults: ATorch's documented ones, its extra args, then the search budget (not in ATorch).
KARGS: dict[str, Any] = {
    "verbose": False,
    "time_limit": None,
    "find_unused_parameters": None,
    "ignore_dryrun_on_load_strategy": True,  # ATorch's documented default (its code reads False)
    # ATorch's AutoAccelerateExtraArgs and its meta-init keyword
    "sample_batch": None,  # a batch standing in for the dataset in dry runs and the search
    "batch_size": None,  # the global batch of those measurements (default: sample_batch's rows)
    "expand_sample_batch": False,  # repeat sample_batch's rows up to batch_size
    "sampler_seed": None,  # the distributed sampler's seed (ATorch: 0)
    "meta_init_offload_name": None,  # accepted, no effect here (see NO_EFFECT)
    # the search (not in ATorch)
    "n_trials": None,  # plans to measure in fully automatic mode; default 12 when there is no time_limit
    "memory_limit": None,  # peak bytes per rank (or "300MiB"); over-budget plans are infeasible
    "storage": None,  # sqlite path / optuna URL to persist and resume the study
    "study_name": None,
    "seed": 0,
    "trial_timeout": 120.0,
    # seconds the search may spend predicting plans before its first trial (None: StudyOptions' own)
    "predict_ahead_s": None,
}
#: keywords ATorch reads that change nothing here, and why (explain() shows the note when one is given)
NO_EFFECT = {
    "meta_init_offload_name": "ATorch offloads meta-initialized weights under this name for its FSDP loader; "
    "here the model arrives built on the CPU and fsdp shards it in place, so there is nothing to offload",
}
MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")


def default_prepare_input(data, device):
    """ATorch's default: move the batch (tensors inside tuples, lists and dicts) to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {k: default_prepare_input(v, device) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return type(data)(default_prepare_input(v, device) for v in data)
    return data


@dataclasses.dataclass(frozen=True)
class SeedLoss:
    """ATorch's loop as a picklable ``loss_fn(model, batch)`` for the search's workers."""

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
    """Plan settings ATorch passes outside the strategy, set on whichever transform has the field."""

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


def _rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    if isinstance(batch, dict):
        return min((_rows(v) for v in batch.values()), default=0)
    if isinstance(batch, list | tuple):
        return min((_rows(v) for v in batch), default=0)
    return 0


def _row(batch, i):
    if isinstance(batch, torch.Tensor):
        return batch[i]
    if isinstance(batch, dict):
        return {k: _row(v, i) for k, v in batch.items()}
    return type(batch)(_row(v, i) for v in batch)


@dataclasses.dataclass(frozen=True)
class SampleBatchDataset(torch.utils.data.Dataset):
    """ATorch's ``sample_batch`` as a dataset of its rows (repeated cyclically up to ``size``), for
    dry runs and the search when no dataset is given. The default collate stacks rows back into
    the sample's structure."""

    sample_batch: Any
    size: int

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return _row(self.sample_batch, i % _rows(self.sample_batch))


@dataclasses.dataclass(frozen=True)
class Request:
    """One auto_accelerate call, checked: what the private steps (dry run, search, apply) read."""

    model: Any
    optim_func: Any = None
    dataset: Any = None
    loss_func: Any = None
    prepare_input: Any = None
    model_input_format: str | None = None
    optim_args: Any = None
    optim_param_func: Any = None
    dataloader_args: Any = None
    distributed_sampler_cls: Any = None
    excluded: tuple = ()
    included: tuple = ()
    load_strategy: Any = None
    lr_scheduler_cls: Any = None
    lr_scheduler_args: Any = None
    finetune_strategy: bool = False
    save_strategy_to_file: Any = None
    opts: Any = dataclasses.field(default_factory=lambda: dict(KARGS))

    @classmethod
    def of(cls, model, kargs: dict, **named) -> Request:
        """Check the call (typed errors, before any work) and freeze it."""
        unknown = sorted(set(kargs) - set(KARGS))
        if unknown:
            raise ConfigError(
                f"auto_accelerate keyword {unknown[0]!r}",
                kargs[unknown[0]],
                f"one of {sorted(KARGS)} (ATorch ignores unknown keywords; here a misspelling is an error)",
            )
        for name in ("excluded", "included"):
            value = named.get(name)
            if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
                raise ConfigError(name, value, "a list of optimization method names")
            named[name] = tuple(value or ())
        named["dataloader_args"] = dict(named.get("dataloader_args") or {})
        request = cls(model=model, opts=types.MappingProxyType({**KARGS, **kargs}), **named)
        request._check()
        return request

    def _check(self) -> None:
        o = self.opts
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError("model", type(self.model).__name__, "a torch.nn.Module")
        if self.model_input_format not in MODEL_INPUT_FORMATS:
            raise ConfigError("model_input_format", self.model_input_format, "None, 'unpack_sequence' or 'unpack_dict'")
        if self.optim_func is not None and not callable(self.optim_func):
            raise ConfigError(
                "optim_func",
                self.optim_func,
                "an optimizer class or a function (parameters, **optim_args) -> optimizer",
            )
        if self.lr_scheduler_cls is not None and self.optim_func is None:
            raise ConfigError(
                "lr_scheduler_cls",
                self.lr_scheduler_cls,
                "None when there is no optim_func (a scheduler needs an optimizer)",
            )
        b = o["batch_size"]
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ConfigError(
                "batch_size", b, "None or the global batch size of sample_batch measurements, an integer >= 1"
            )
        if not isinstance(o["expand_sample_batch"], bool):
            raise ConfigError("expand_sample_batch", o["expand_sample_batch"], "True or False")
        seed = o["sampler_seed"]
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError("sampler_seed", seed, "None or an integer (the distributed sampler's seed)")
        name = o["meta_init_offload_name"]
        if name is not None and not isinstance(name, str):
            raise ConfigError("meta_init_offload_name", name, "None or a string")
        if o["sample_batch"] is not None:
            rows = _rows(o["sample_batch"])
            if rows < 1:
                raise ConfigError(
                    "sample_batch",
                    type(o["sample_batch"]).__name__,
                    "a batch: a tensor, or a list / tuple / dict of tensors, sharing a first (batch) dimension >= 1",
                )
            if b is not None and b > rows and not o["expand_sample_batch"]:
                raise ConfigError(
                    "batch_size",
                    b,
                    f"at most sample_batch's {rows} rows, or pass expand_sample_batch=True to repeat them up to {b}",
                )
        if self.finetune_strategy and self.load_strategy is not None and not self.can_train:
            raise ConfigError(
                "finetune_strategy",
                True,
                "False unless optim_func, loss_func and a dataset (or sample_batch=) are given "
                "(fine-tuning measures training steps)",
            )
        if self.load_strategy is None:
            missing = [n for n, v in (("optim_func", self.optim_func), ("loss_func", self.loss_func)) if v is None]
            if self.dataset is None and o["sample_batch"] is None:
                missing.append("dataset")
            if missing:
                raise ConfigError(
                    missing[0],
                    None,
                    "given: fully automatic mode (no load_strategy) measures training steps, "
                    "so it needs optim_func, loss_func and a dataset (or sample_batch=)",
                )

    @property
    def optim_maker(self) -> SeedOptimizer | None:
        return (
            None if self.optim_func is None else SeedOptimizer(self.optim_func, self.optim_args, self.optim_param_func)
        )

    @property
    def settings(self) -> Settings:
        return Settings(self.opts["find_unused_parameters"], self.distributed_sampler_cls)

    @property
    def can_train(self) -> bool:
        return None not in (self.optim_func, self.loss_func) and (
            self.dataset is not None or self.opts["sample_batch"] is not None
        )

    def workload(self):
        """What a dry run or a trial trains: the dataset, or sample_batch's rows when there is none."""
        from composable_atorch.auto.workload import Workload

        args = self.dataloader_args
        dataset, batch_size = self.dataset, args.get("batch_size", 1)
        if dataset is None:
            sample = self.opts["sample_batch"]
            batch_size = self.opts["batch_size"] or _rows(sample)
            dataset = SampleBatchDataset(sample, max(batch_size, _rows(sample)))
        loader_kwargs = {k: v for k, v in args.items() if k not in ("batch_size", "sampler", "batch_sampler")}
        loader_kwargs.setdefault("shuffle", False)
        loader_kwargs.setdefault("drop_last", False)
        return Workload(
            ModelCopy(self.model),
            self.optim_maker,
            dataset,
            SeedLoss(self.loss_func, self.prepare_input, self.model_input_format),
            batch_size,
            loader_kwargs,
        )

    def search_policies(self, loaded: Plan | None, world_size: int) -> tuple:
        """What the fully automatic mode's search takes, checked: ``(workload, trial, budget, space,
        study)`` from ATorch's keywords and this library's search keywords (``n_trials`` defaults to 12
        without a ``time_limit``); ``loaded`` (a strategy to fine-tune) is measured first."""
        from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings

        o = self.opts
        if not self.can_train:
            why = "given, with loss_func and a dataset (or sample_batch=): the search trains"
            raise ConfigError("optim_func", self.optim_func, why)
        n_trials = o["n_trials"] if o["n_trials"] is not None or o["time_limit"] is not None else 12
        ahead = {} if o["predict_ahead_s"] is None else {"predict_ahead_s": o["predict_ahead_s"]}
        policies = (
            TrialSettings(world_size=world_size, timeout=o["trial_timeout"], measure_steps=5),
            Budget(n_trials=n_trials, time_limit=o["time_limit"], memory_limit=o["memory_limit"]),
            SpaceOptions(excluded=self.excluded, included=self.included, start_from=loaded, customize=self.settings),
            StudyOptions(storage=o["storage"], study_name=o["study_name"], seed=o["seed"], **ahead),
        )
        return (self.workload(), *policies)

    def notes(self) -> tuple[str, ...]:
        """What explain() adds for keywords accepted with no effect, or with an effect worth saying."""
        o, out = self.opts, []
        for key, why in NO_EFFECT.items():
            if o[key] is not None:
                out.append(f"auto_accelerate {key}={o[key]!r}: no effect here: {why}")
        if o["sample_batch"] is not None and self.dataset is not None:
            out.append(
                "auto_accelerate sample_batch: no effect: a dataset is given, and dry runs and the search train on it"
            )
        if not o["ignore_dryrun_on_load_strategy"] and self.load_strategy is not None and not self.can_train:
            out.append(
                "auto_accelerate ignore_dryrun_on_load_strategy=False: dry run skipped, as ATorch skips it: "
                "it needs optim_func, loss_func and a dataset (or sample_batch=)"
            )
        if o["batch_size"] is not None and (self.dataset is not None or o["sample_batch"] is None):
            out.append(
                "auto_accelerate batch_size: no effect: it sizes sample_batch measurements only; "
                "the returned loader's global batch is dataloader_args['batch_size']"
            )
        return tuple(out)

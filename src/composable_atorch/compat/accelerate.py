"""ATorch's ``auto_accelerate``: a thin facade over strategies, the search and plans.

``load_strategy`` given -> semi-automatic: the strategy is loaded (any form strategy.load takes),
checked by compose() and applied; with ``ignore_dryrun_on_load_strategy=False`` it is first run
once in fresh processes and a failure returns ``status False``. ``finetune_strategy=True`` measures
it first and then searches around it. Without ``load_strategy`` -> fully automatic: the optuna
search (:func:`composable_atorch.auto.search`) picks the plan.

Under torchrun every rank calls this. Rank 0 decides the plan (loads it, or searches in fresh
worker processes at this world size) and broadcasts the plan as JSON text; every rank composes
it again against its own process and applies it. Errors the caller can fix are raised on every
rank before any work.

ATorch's keywords (its ``AutoAccelerateExtraArgs`` and ``meta_init_offload_name``) are accepted:
``sample_batch`` stands in for the dataset in dry runs and the search, ``batch_size`` is the
global batch of those measurements, ``expand_sample_batch`` repeats the sample's rows up to it,
``sampler_seed`` seeds the distributed sampler; one that has no effect in a call says so in
``best_strategy.explain()``. Where this differs from ATorch on purpose:

* an unknown keyword is a ConfigError (ATorch ignores it), pickled strategies are refused;
* ``best_strategy`` is an :class:`AtorchStrategy`: ``len`` counts implied steps too, and each
  entry says whether it was requested or implied;
* a user's model / loss that fails with no plan raises WorkloadError on every rank (ATorch's
  engine returns ``status False``);
* ``ignore_dryrun_on_load_strategy`` defaults to True, as ATorch's documentation says.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import namedtuple

import torch

from composable_atorch.compat import groups
from composable_atorch.compat.request import (
    AccelerateArgs,
    Request,
    default_prepare_input,
)
from composable_atorch.compat.tp_shrink import resolve_shrinks
from composable_atorch.core import strategy
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError, ConfigError, WorkloadError
from composable_atorch.runtime.optim import OptimizerHook

#: ATorch's ``AutoAccelerateResult`` fields, in ATorch's order.
AccelerateResult = namedtuple(
    "AccelerateResult", ["model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args"]
)


class AtorchStrategy(Plan):
    """The returned ``best_strategy``: a Plan (reusable as ``load_strategy``, JSON via strategy.dump)
    that also reads as ATorch's Strategy.

    ``len(s)`` counts every step, the requested ones and those compose() implied (at world 2,
    ``["parallel_mode"]`` gives parallel_mode plus the ddp it implies: length 2 where ATorch says 1).
    Iterating gives :class:`StrategyEntry` triples ``(name, config, tunable)`` as ATorch's, each
    with ``.implied_by`` (None for a requested step) so the difference shows; ``requested_names``
    is what ATorch's ``len`` counts.
    """

    @classmethod
    def of(cls, plan: Plan, notes: tuple[str, ...] = ()) -> AtorchStrategy:
        out = cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})
        object.__setattr__(out, "facade_notes", tuple(notes))  # not part of equality or the JSON
        return out

    def __iter__(self):
        for step in self.steps:
            yield StrategyEntry.of(step)

    @property
    def requested_names(self) -> tuple[str, ...]:
        return tuple(s.transform.name for s in self.steps if s.implied_by is None)

    @property
    def implied_names(self) -> tuple[str, ...]:
        return tuple(s.transform.name for s in self.steps if s.implied_by is not None)

    def opt_names(self) -> list[str]:
        """ATorch's ``Strategy.opt_names()``: every step's name, implied ones included."""
        return list(self.names)

    # the rest of ATorch's Strategy reading surface (a plan is immutable: add_opt / __setitem__ are not offered)
    @property
    def opt_list(self) -> list[StrategyEntry]:
        return list(self)

    def __getitem__(self, idx):
        return self.opt_list[idx]

    def is_tunable(self) -> bool:
        """False: every step of a returned plan has its configuration."""
        return False

    def get_parallel_mode(self):
        """ATorch's ``(found, config)`` for parallel_mode (config as this library holds it)."""
        entry = next((e for e in self if e[0] == "parallel_mode"), None)
        return (False, None) if entry is None else (True, entry[1])

    def explain(self, applied=None) -> str:
        text = super().explain(applied)
        extra = getattr(self, "facade_notes", ())
        return text + "".join(f"\n  note: {n}" for n in extra)


class StrategyEntry(tuple):
    """``(name, config, tunable)`` as ATorch's strategy items unpack, plus ``implied_by``."""

    implied_by: str | None

    @classmethod
    def of(cls, step) -> StrategyEntry:
        entry = super().__new__(cls, (step.transform.name, step.transform.config(), False))
        entry.implied_by = step.implied_by
        return entry

    @property
    def requested(self) -> bool:
        return self.implied_by is None

    def __repr__(self):
        mark = "requested" if self.implied_by is None else f"implied by {self.implied_by}"
        return f"({self[0]!r}, {self[1]!r}, {self[2]!r}; {mark})"


def _ensure_process_group(env_world: int) -> None:
    import torch.distributed as dist

    if env_world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


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

    ``result`` is ``AccelerateResult(model, optim, dataloader, loss_func, prepare_input,
    lr_scheduler, args)`` in ATorch's order; ``result.loss_func`` returns a loss whose plain
    ``.backward()`` goes through the plan's optimizer (loss scaling, accumulation), and
    ``result.args`` reads as attributes or as ATorch's dict. ``best_strategy`` is an
    :class:`AtorchStrategy` (a Plan, reusable as ``load_strategy``), saved as JSON to
    ``save_strategy_to_file`` when given (never pickle).
    """
    load_strategy, shrink_notes = resolve_shrinks(model, load_strategy)  # ATorch's transformers 4 TPInfo
    req = Request.of(
        model,
        kargs,
        optim_func=optim_func,
        dataset=dataset,
        loss_func=loss_func,
        prepare_input=prepare_input,
        model_input_format=model_input_format,
        optim_args=optim_args,
        optim_param_func=optim_param_func,
        dataloader_args=dataloader_args,
        distributed_sampler_cls=distributed_sampler_cls,
        excluded=excluded,
        included=included,
        load_strategy=load_strategy,
        lr_scheduler_cls=lr_scheduler_cls,
        lr_scheduler_args=lr_scheduler_args,
        finetune_strategy=finetune_strategy,
        save_strategy_to_file=save_strategy_to_file,
    )
    plan = _agreed_plan(req, shrink_notes)
    if plan is None:
        return False, None, None
    if save_strategy_to_file:
        _save_strategy(plan, save_strategy_to_file)
    model, optim, loader = _apply(req, plan)
    if req.opts["verbose"] and _rank() == 0:
        print(plan.explain())  # after _apply: its notes (sampler_seed's) are part of the plan's explanation
    return True, _result(req, model, optim, loader), plan


def _agreed_plan(req: Request, shrink_notes: tuple[str, ...]) -> AtorchStrategy | None:
    """The plan every rank applies, the same on each; None when there is none (``status False``).

    A loaded plan holding functions cannot travel as JSON: each rank applies the one it loaded
    itself. Otherwise rank 0 decides (loads, dry-runs or searches) and broadcasts the plan as JSON
    text, so the ranks cannot disagree; the user's own code failing with no plan at all is a
    WorkloadError raised on every rank, so none is left waiting in a collective.
    """
    opts = req.opts
    env = Environment.detect()
    _ensure_process_group(env.world_size)
    loaded = (
        None if req.load_strategy is None else req.settings(strategy.load(req.load_strategy, env=env))
    )  # typed errors on every rank

    local = _unserializable(req, loaded)
    if local is not None:  # every rank applies the plan it loaded itself (it holds functions: not JSON)
        return AtorchStrategy.of(local, req.notes() + shrink_notes)
    payload = _decide(req, loaded, env) if _rank() == 0 else None
    decided = json.loads(_broadcast(payload))
    if decided.get("workload_error"):
        raise WorkloadError(**decided["workload_error"])  # on every rank: the user's code fails with no plan
    if decided["failure"]:
        if opts["verbose"] and _rank() == 0:
            print(f"auto_accelerate: no plan: {decided['failure']}")
        return None
    # rank 0's text names what this rank holds too: the strategy's classes and the model's own
    trusted = handed_over(req.model, loaded)
    return AtorchStrategy.of(Plan.from_json(decided["plan"], env=env, allow=trusted), req.notes() + shrink_notes)


def _save_strategy(plan: AtorchStrategy, path) -> None:
    """``save_strategy_to_file``: the plan as JSON (never pickle), written once by rank 0."""
    if _rank() == 0:
        strategy.dump(plan, path)
    _barrier()  # every rank may read the file as soon as the call returns (ATorch writes it on each rank)


def _apply(req: Request, plan: AtorchStrategy) -> tuple:
    """Build the user's optimizer and loader, apply the plan to them with the model, and wire what
    ATorch's callers read besides the plan's result: the groups of its module-level helpers, a
    DeepSpeed pipeline engine's loss, the sampler's seed. Returns ``(model, optim, loader)``."""
    model = req.model
    optim_maker = req.optim_maker
    optim = optim_maker(model) if optim_maker else None
    loader = None if req.dataset is None else torch.utils.data.DataLoader(req.dataset, **req.dataloader_args)
    applied = plan(model, optim, loader)
    model, optim, loader = applied
    groups.record(applied.state.parallel)  # for ATorch's module-level helpers (compat.atorch.distributed)
    if req.loss_func is not None and hasattr(getattr(model, "module", None), "loss_fn"):
        model.module.loss_fn = (
            req.loss_func  # a DeepSpeed pipeline engine computes the loss inside train_batch (ds_3d_parallel)
        )
    _seed_sampler(loader, req.opts["sampler_seed"], plan)
    return model, optim, loader


def _result(req: Request, model, optim, loader) -> AccelerateResult:
    """ATorch's ``AutoAccelerateResult`` around the applied plan: the scheduler built on the plan's
    optimizer, ``args`` saying whether the backward must go through it, and a loss function whose
    plain ``.backward()`` does (loss scaling, accumulation)."""
    scheduler = None
    if req.lr_scheduler_cls is not None:
        scheduler = req.lr_scheduler_cls(optim, **(req.lr_scheduler_args or {}))
    args = AccelerateArgs(
        use_optim_backward=_needs_optim_backward(optim),
        requires_set_gradient_accumulation_boundary=_needs_boundary(optim),
    )
    wrap = getattr(optim, "loss_wrapper", None)
    loss_func = req.loss_func
    result_loss = wrap(loss_func) if callable(wrap) and loss_func is not None else loss_func
    return AccelerateResult(
        model, optim, loader, result_loss, req.prepare_input or default_prepare_input, scheduler, args
    )


def handed_over(model, loaded: Plan | None) -> tuple:
    """The classes and functions the user handed over in code on this rank: the loaded strategy's
    (``("checkpoint", (Block,))``) and the classes of the model's modules (the search's block
    classes). Rank 0's plan text may name them whatever module they live in (the script's
    ``__main__``, a spawned ``__mp_main__``, a notebook): they are trusted, not looked up."""
    own = {type(m) for m in model.modules()}
    return tuple(own) + (loaded.named_objects() if loaded is not None else ())


def _unserializable(req: Request, loaded: Plan | None) -> Plan | None:
    """A loaded plan whose configs hold functions (ds_3d_parallel's patchers...) cannot travel as JSON
    from rank 0: with nothing to decide (no dry run, no fine-tuning) each rank applies its own."""
    if loaded is None or req.finetune_strategy:
        return None
    try:
        loaded.to_json()
        return None
    except ConfigError as exc:
        why = f"the strategy holds values JSON cannot hold ({exc})"
    if not req.opts["ignore_dryrun_on_load_strategy"] and req.can_train:
        raise ConfigError(
            "ignore_dryrun_on_load_strategy", False, f"True: a dry run runs the plan in fresh processes, and {why}"
        )
    if req.save_strategy_to_file:
        raise ConfigError("save_strategy_to_file", req.save_strategy_to_file, f"None: {why}")
    return loaded


def _decide(req: Request, loaded: Plan | None, env: Environment) -> str:
    """Rank 0: the plan as JSON text, or why there is none (a JSON payload for every rank)."""
    text, failure = None, None
    try:
        if loaded is not None and not req.finetune_strategy:
            text = loaded.to_json()
            if not req.opts["ignore_dryrun_on_load_strategy"] and req.can_train:  # ATorch skips it too otherwise
                failure = _dry_run(req, loaded)
        else:
            text, failure = _search(req, loaded, env)
    except WorkloadError as exc:
        return json.dumps(
            {
                "plan": None,
                "failure": str(exc),
                "workload_error": {"part": exc.part, "error": exc.error, "hint": exc.hint},
            }
        )
    except CompositionError as exc:
        failure = f"{type(exc).__name__}: {exc}"
    return json.dumps({"plan": None if failure else text, "failure": failure})


def _seed_sampler(loader, seed: int | None, plan: AtorchStrategy) -> None:
    """ATorch's ``sampler_seed``: the distributed sampler's shuffling seed."""
    if seed is None:
        return
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, torch.utils.data.distributed.DistributedSampler) or hasattr(sampler, "seed"):
        sampler.seed = seed
        return
    why = (
        "there is no loader (no dataset)"
        if loader is None
        else "the loader has no distributed sampler (a single data shard)"
    )
    object.__setattr__(
        plan, "facade_notes", plan.facade_notes + (f"auto_accelerate sampler_seed={seed}: no effect: {why}",)
    )


def _needs_optim_backward(optim) -> bool:
    """True when a hook changes the backward pass (loss scaling, accumulation, skipped sync...)."""
    base = OptimizerHook
    hooks = getattr(optim, "hooks", ())
    return any(
        type(h).scale_loss is not base.scale_loss
        or type(h).backward is not base.backward
        or type(h).backward_context is not base.backward_context
        for h in hooks
    )


def _needs_boundary(optim) -> bool:
    """The returned optimizer counts micro-batches itself; only a hook that says so needs the calls."""
    return any(getattr(h, "requires_boundary_calls", False) for h in getattr(optim, "hooks", ()))


def _dry_run(req: Request, plan: Plan) -> str | None:
    from composable_atorch.auto.policy import TrialSettings
    from composable_atorch.auto.trial import ProcessRunner

    world = int(os.environ.get("WORLD_SIZE", plan.env.world_size))
    timeout = req.opts["trial_timeout"]
    runner = ProcessRunner(req.workload(), TrialSettings(world_size=world, timeout=timeout, measure_memory=False))
    result = runner(plan, timeout=timeout)
    if req.opts["verbose"]:
        print(
            f"auto_accelerate: dry run {result.status}"
            + (f": {result.reason}" if result.reason else f", {result.samples_per_s:.1f} samples/s")
        )
    return None if result.ok else f"dry run failed: {result.reason}"


def _search(req: Request, loaded: Plan | None, env: Environment) -> tuple[str | None, str | None]:
    from composable_atorch.auto import report
    from composable_atorch.auto.study import search

    workload, trial, budget, space, study = req.search_policies(loaded, env.world_size)
    o = req.opts
    result = search(
        workload, trial=trial, budget=budget, space=space, study=study, env=env, progress=bool(o["verbose"])
    )
    if o["verbose"]:
        print(report.text_table(result))
    if result.best_plan is None:
        return (
            None,
            f"no plan trained within the budget ({len(result.measured)} measured; stopped by {result.stopped_by})",
        )
    return result.best_plan.to_json(), None

"""Sharded, atomic save and resume of a training run on torch.distributed.checkpoint (DCP).

    step, extra = load_state(ckpt, model, optim, loader) if latest_checkpoint(ckpt) else (0, {})
    for x, y in loader:
        ...; step += 1
        if step % 100 == 0:
            save_state(ckpt, model, optim, loader, step=step)

What is saved, and where
    ``ckpt/step-00000100/`` holds DCP's files (each rank writes its own shard of the model and
    optimizer state — FSDP's DTensors stay sharded, DDP's replicas are written once), one
    ``rank-N.json`` per rank (RNG states, the loader's data position, the plan optimizer's hook
    states and accumulation micro-step) and ``checkpoint.json`` (step, world size, user extra,
    the optimizer's shape). ``ckpt/latest.json`` names the newest complete checkpoint. A ZeRO-1
    optimizer (ZeroRedundancyOptimizer, fairscale OSS) is saved from its local optimizer: each
    rank writes its own partition, by parameter name. A save inside an accumulation window also
    saves each rank's accumulated gradients (not with FSDP, which keeps them in its own buffers:
    that is a ConfigError; save after ``optim.step()``).

Why it survives a crash
    Everything is written into ``ckpt/.step-00000100.partial`` and fsynced (DCP's
    ``sync_files``, our JSON files too); only then rank 0 renames the directory into place and
    moves ``latest.json`` (written to a temporary file, fsynced, ``os.replace``-d). A process
    killed at any point leaves ``latest.json`` naming the previous complete checkpoint; the next
    save clears the stale partial directory. A write that fails (a full disk, on any rank) is a
    CheckpointWriteError naming the directory and the cause, raised alike on every rank (none is
    left waiting for another), with the partial directory removed and nothing published (writes.py).

Why it resumes bitwise
    Weights and optimizer state come back through ``get_state_dict`` / ``set_state_dict`` (which
    handle DDP, FSDP2 and plain modules alike); RNG states come back per rank; the loader (made
    resumable by the plan, see resumable.py) continues with exactly the next batch, replaying its
    pass's shuffle, and the LR scheduler's state (JSON) comes back as saved.

At another world size or layout (elastic restarts)
    The user's script does not change: the same plan expression, applied at the new world,
    refits its data size (``parallel_mode``'s data dimension absorbs the world; tensor and
    pipeline sizes are kept, and a world they do not divide is a ConfigError naming the nearest
    layout and the worlds that keep them; explain() says what was refitted). Then load_state:

    * weights and optimizer state: DCP reshards them across DDP / FSDP / tensor / pipeline layouts
      (a pipeline stage reads its own blocks' part of the checkpoint); expert-parallel experts are
      written as each rank's rows of the whole ``[E, ...]`` tensor (fsdp-sharded ones as their
      sub-rows over the ``(expert, data)`` mesh) and read at the loading run's expert degree
      (transforms.parallel.expert.checkpoint); context and Ulysses ranks hold whole weights;
    * the data position: under a process group a plan reads one global order at every data size
      (a DistributedSampler of the same seed, also at a data size of 1), and the position is saved
      as the global samples consumed in the epoch (resumable.py; the ranks splitting a sequence
      read the same samples, and the expert dimension splits the batch like data); each rank derives its skip from
      the new layout, so every sample is trained once per epoch and each step sees the same global
      batch (the global batch is kept; one that does not divide over the new data size is a
      ConfigError naming the world sizes that work, before any work);
    * the LR scheduler: its state is world-independent and comes back as saved;
    * the loss and weights then follow the uninterrupted run to fp32 reduction order (not bitwise:
      another data size sums the gradients in another order);
    * RNG: per-rank states cannot carry over to another rank count and are left as the new run
      seeded them: dropout masks (and anything else drawing per rank) differ from the
      uninterrupted run after the resume. Same world, same layout: everything is bitwise.

Opened elsewhere (no plan, one process, another sampler)
    Any layout's checkpoint loads into the plain model in one process (DCP gathers the shards; a
    pipeline run's optimizer shape is saved joined over its stages). A loader reading another
    sample order than the saved run's cannot continue its position: weights, optimizer and
    scheduler load, the loader is left as given, and the result says so (resumed.py);
    ``load_state(..., exact_resume=True)`` refuses instead.

Asynchronous
    ``save_state(..., asynchronous=True)`` returns once DCP's ``async_save`` has staged the
    tensors; the same files, manifest and atomic publish follow on a background thread
    (inflight.py), waited for by the next save, by load_state and at exit.

Why a damaged or crafted checkpoint is refused
    ``checkpoint.json`` lists every file with its size and blake2b digest and carries its own;
    ``load_state`` (load.py) verifies them all, reads DCP's pickled ``.metadata`` through an
    allow-list unpickler, and loads into fresh tensors copied into the model only once every shard
    was read (verify.py). A re-save of a step swaps the new copy in without a moment when neither is
    complete (files.py).

Nothing here pickles: metadata is JSON; tensors go through DCP's own format.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from composable_atorch.errors import ConfigError
from composable_atorch.runtime import resumable as _resumable
from composable_atorch.runtime.optim import PlanOptimizer
from composable_atorch.state import inflight, writes
from composable_atorch.state.files import (
    FORMAT,
    VERSION,
    check_jsonable,
    checkpoint_name,
    latest_checkpoint,
    prune,
    publish,
    write_json,
)
from composable_atorch.state.resumed import Resumed
from composable_atorch.transforms.parallel.expert import checkpoint as expert_checkpoint
from composable_atorch.transforms.parallel.tensor import save_layout

__all__ = ["Resumed", "latest_checkpoint", "save_state", "wait_for_saves"]

wait_for_saves = inflight.wait_for_saves


# -- small helpers ---------------------------------------------------------------------------------
def _dcp():
    """torch.distributed.checkpoint and its state-dict API, imported on first use (~1 s to import)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd, sd.StateDictOptions(flatten_optimizer_state_dict=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _single_process_is_intended():
    """Without a process group DCP warns that it assumes one process; here that is the design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _split_optimizer(optim) -> tuple[torch.optim.Optimizer | None, list, int]:
    """(inner torch optimizer, plan hooks, accumulation micro-step) of a PlanOptimizer or a plain one."""
    if optim is None:
        return None, [], 0
    if isinstance(optim, PlanOptimizer):
        return optim.optimizer, list(optim.hooks), optim.micro_step
    if isinstance(optim, torch.optim.Optimizer):
        return optim, [], 0
    raise ConfigError("optim", type(optim).__name__, "the optimizer a plan returned, a torch.optim.Optimizer, or None")


def _state_optimizer(inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state DCP saves: a ZeRO-1 optimizer's local one (this rank's partition).

    torch's ZeroRedundancyOptimizer and fairscale's OSS keep the state of this rank's parameters
    in ``.optim``; saved by parameter name from there, each rank writes its own partition, and a
    load at any world size reads the partition it owns then.
    """
    local = getattr(inner, "optim", None)
    return local if isinstance(local, torch.optim.Optimizer) and local is not inner else inner


def _sync_hyperparameters(inner: torch.optim.Optimizer, local: torch.optim.Optimizer) -> None:
    """After a load into a ZeRO optimizer's local one, its wrapper's groups take the loaded values."""
    if local is inner or len(local.param_groups) != len(inner.param_groups):
        return
    for outer, group in zip(inner.param_groups, local.param_groups):
        outer.update({k: v for k, v in group.items() if k != "params"})


def _optimizer_shape(inner: torch.optim.Optimizer, hooks: list) -> dict[str, Any]:
    return {
        "class": type(_state_optimizer(inner)).__name__,  # ZeRO-1 at world 2 loads into the plain one at world 1
        "group_sizes": [len(g["params"]) for g in inner.param_groups],
        "hooks": [type(h).__name__ for h in hooks],
    }


def _joined_group_sizes(model: torch.nn.Module, inner: torch.optim.Optimizer) -> list[int]:
    """Each param group's parameter count over the whole model, joined across ranks.

    A pipeline stage's optimizer holds its own stage's parameters only; tensor and fsdp ranks hold
    shards of the same names. The saved shape is therefore the union of every rank's parameter
    names per group (a name is one parameter, as DCP keys it), which is what a plan-free model or
    any other layout's full model has: a checkpoint of pipeline stages then loads anywhere.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    mine = [sorted(names.get(id(p), f"#{i}") for i, p in enumerate(g["params"])) for g in inner.param_groups]
    if not _distributed():
        return [len(group) for group in mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [len(set().union(*(r[i] for r in everyone if i < len(r)))) for i in range(len(mine))]


def _plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def group_hyperparameters(inner: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's plain hyperparameters (lr, momentum, betas...) as JSON.

    DCP saves them with the optimizer's state, which a stateless optimizer (SGD without momentum)
    never has: without this copy its LR, as an LR scheduler left it, would come back as the
    constructor's while the scheduler's own state says otherwise.
    """
    return [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params" and _plain(v)}
        for g in inner.param_groups
    ]


def restore_hyperparameters(inner: torch.optim.Optimizer, saved: list[dict[str, Any]] | None) -> None:
    """Put :func:`group_hyperparameters` back (tuples stay tuples), for an optimizer loaded without state."""
    if not isinstance(saved, list) or len(saved) != len(inner.param_groups):
        return
    for group, values in zip(inner.param_groups, saved):
        if not isinstance(values, dict):
            continue
        for k, v in values.items():
            if k in group and k != "params" and _plain(v) and _same_kind(group[k], v):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _same_kind(current: Any, saved: Any) -> bool:
    """A checkpoint is untrusted: a saved value replaces only one of its own kind (a number a
    number, a tuple of n numbers a list of n), so a crafted file cannot put a string into ``lr``."""
    if isinstance(current, tuple):
        return isinstance(saved, list) and len(saved) == len(current)
    if isinstance(current, bool) or current is None:
        return type(saved) is type(current)
    if isinstance(current, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    return type(saved) is type(current)


def refuse_expert_parallel(model: torch.nn.Module, who: str) -> None:
    """Expert-parallel experts a checkpoint cannot place in the whole (see
    transforms.parallel.expert.checkpoint): a ConfigError naming them and why, before any work."""
    split = expert_checkpoint.unsupported(model)
    if split:
        raise ConfigError(
            f"{who} of an expert-parallel model",
            "; ".join(split[:3]) + (" ..." if len(split) > 3 else ""),
            "experts sharded by fsdp over meshes of parallel_mode's dimensions (fsdp() as the plan applies it) or "
            "kept whole by ddp: these experts' rows cannot be placed in the whole tensor the checkpoint holds",
        )


def _has_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _grad_state(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """This rank's accumulated local gradients (mid-window saves), under rank-specific keys."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            out[f"rank{rank}.{name}"] = grad.detach()
    return out


# -- save ------------------------------------------------------------------------------------------
def _state_to_write(model: torch.nn.Module, local, micro_step: int, rank: int) -> dict[str, Any]:
    """What DCP writes: the model's (and ``local`` optimizer's) state dict in the user's layout, and
    a mid-window save's gradients. Without optimizer state (``local`` None) only the model's:
    get_state_dict would initialise the state with a zero step, changing training."""
    _, sd, options = _dcp()
    if local is not None:
        model_sd, optim_sd = sd.get_state_dict(model, [local], options=options)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": sd.get_model_state_dict(model, options=options)}
    state = save_layout(model, state)  # fused (strided) tensor-parallel layers in the user's layout
    expert_checkpoint.to_global(model, state["model"], state.get("optim"))  # each rank's experts as its shard
    if micro_step:
        state["grads"] = _grad_state(model, rank)
    return state


def _check_arguments(model, step, keep, extra, loader, asynchronous) -> None:
    """save_state's arguments, each a ConfigError naming the fix, before anything is written."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError("save_state step", step, "an integer >= 0")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError("save_state keep", keep, "an integer >= 1, or None to keep every checkpoint")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError("save_state extra", type(extra).__name__, "a dict of JSON values, or None")
    if loader is not None and not _resumable.is_resumable(loader):
        raise ConfigError(
            "save_state loader",
            type(loader).__name__,
            "the loader a plan returned, or composable_atorch.resumable(loader) called before iterating it "
            "(a plain DataLoader does not know how far it was iterated), or loader=None",
        )
    if not isinstance(asynchronous, bool):
        raise ConfigError("save_state asynchronous", asynchronous, "True or False")


def save_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optim=None,
    loader=None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
    scheduler=None,
    asynchronous: bool = False,
) -> Path | inflight.SaveInFlight:
    """Save model, optimizer (with the plan's hook states), LR scheduler, data position and RNG states.

    Call it on every rank (it is collective when a process group exists), after ``optim.step()``
    of the step you count in ``step``. ``extra`` is any JSON dict (returned by load_state).
    ``keep`` prunes all but the newest ``keep`` checkpoints. ``scheduler`` (a torch LR scheduler)
    is saved as JSON and restored by ``load_state(..., scheduler=)``. Returns the checkpoint's directory.

    ``asynchronous=True`` returns once the tensors are copied to CPU memory (DCP's async_save);
    the files are written, checksummed and published atomically on a background thread while
    training goes on, and the result is a :class:`~composable_atorch.state.inflight.SaveInFlight`
    (path-like; ``.wait()``). The next save, a load and process exit wait for it (inflight.py).
    """
    _check_arguments(model, step, keep, extra, loader, asynchronous)
    refuse_expert_parallel(model, "save_state")
    extra = check_jsonable(dict(extra or {}), "save_state extra")
    scheduler_state = _scheduler_state(scheduler)
    inner, hooks, micro_step = _split_optimizer(optim)
    hook_states = [check_jsonable(h.state_dict(), f"{type(h).__name__}.state_dict()") for h in hooks]
    _refuse_fsdp_mid_window(model, optim, micro_step)
    job, world = _open_job(Path(directory), step)

    local = None if inner is None else _state_optimizer(inner)
    has_optim_state = local is not None and bool(local.state)
    state = _state_to_write(model, local if has_optim_state else None, micro_step, job.rank)
    group_sizes = None if inner is None else _joined_group_sizes(model, inner)  # collective
    position = None if loader is None else loader.position.to_json()
    rank_state = {  # captured now, written with the tensors (on the writing thread when asynchronous)
        "rank": job.rank,
        "rng": _resumable.capture_rng(),
        "loader": position,
        "micro_step": micro_step,
        "hooks": hook_states,
    }
    meta = None
    if job.rank == 0:
        optimizer = None if inner is None else _optimizer_meta(inner, hooks, group_sizes, has_optim_state)
        meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world, "extra": extra}
        meta.update(optimizer=optimizer, micro_step=micro_step, loader=position is not None, scheduler=scheduler_state)
    if not asynchronous:
        return _write_now(job, state, rank_state, meta, keep)
    return _write_in_background(job, state, rank_state, meta, keep)


def _refuse_fsdp_mid_window(model: torch.nn.Module, optim, micro_step: int) -> None:
    """A save inside an accumulation window saves each rank's accumulated gradients; FSDP keeps
    them in its own buffers, where a save cannot reach them: a ConfigError before any work."""
    if micro_step and _has_fsdp(model):
        raise ConfigError(
            "save_state during an accumulation window",
            f"micro-step {micro_step} of {optim.accumulation_steps}",
            "a save right after optim.step() completed a window: FSDP keeps unsynchronised gradients inside its own "
            "buffers",
        )


def _open_job(root: Path, step: int) -> tuple[writes.Writes, int]:
    """Start this save on every rank: ``(its writes, the world size)``.

    One save at a time: the one in flight is published before this one starts. Rank 0 then readies
    an empty partial directory and every rank agrees on it before writing there (a failed write on
    any rank: the same typed error on all).
    """
    inflight.wait_for_saves()
    rank, world = _rank_world()
    job = writes.Writes(root, step, rank)
    if rank == 0:
        job.attempt(lambda: writes.prepare(root, job.partial))
    job.agree()
    return job, world


def _optimizer_meta(inner: torch.optim.Optimizer, hooks: list, group_sizes: list[int], has_state: bool) -> dict:
    """checkpoint.json's optimizer entry: its shape over the whole model, whether DCP holds its state
    (a stateless one has none), and its groups' hyperparameters (DCP saves them only with a state)."""
    optimizer = {**_optimizer_shape(inner, hooks), "group_sizes": group_sizes, "has_state": has_state}
    optimizer["hyperparameters"] = group_hyperparameters(inner)
    return optimizer


def _write_rank_state(job: writes.Writes, rank_state: dict[str, Any]) -> None:
    """This rank's ``rank-N.json`` (RNG, data position, hook states), beside its DCP shard."""
    write_json(job.partial / f"rank-{job.rank}.json", rank_state)


def _write_now(job: writes.Writes, state: dict, rank_state: dict, meta: dict | None, keep: int | None) -> Path:
    """The synchronous save: DCP's files, this rank's JSON, then the manifest and the publish."""
    dcp = _dcp()[0]
    with _single_process_is_intended():
        job.attempt(lambda: dcp.save(state, storage_writer=job.writer, no_dist=not _distributed()))
    job.attempt(lambda: _write_rank_state(job, rank_state))
    job.finish(meta, keep, None, publish=_publish)
    return job.root / checkpoint_name(job.step)


def _write_in_background(
    job: writes.Writes, state: dict, rank_state: dict, meta: dict | None, keep: int | None
) -> inflight.SaveInFlight:
    """The asynchronous save: DCP stages (copies) the tensors here and returns; the same writes,
    manifest and publish as :func:`_write_now` follow on the save thread, over a group of their own
    (a collective there must not interleave with training's on the default group)."""
    dcp = _dcp()[0]
    group = inflight.save_group()
    if group is None:
        # DCP warns from its writing thread, after _single_process_is_intended() has ended (warning
        # filters are process-wide, not per thread): this one message is filtered for good
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    with _single_process_is_intended():  # stages (copies) the tensors here; writes on a thread
        future = dcp.async_save(
            state,
            storage_writer=job.writer,
            process_group=group,
            no_dist=not _distributed(),
            async_checkpointer_type=inflight.checkpointer_type(),
        )

    def write_and_publish() -> None:  # on the writing thread; DCP's failure is raised by result()
        job.attempt(future.result)
        job.attempt(lambda: _write_rank_state(job, rank_state))
        job.finish(meta, keep, group, publish=_publish)

    return inflight.start(job.root / checkpoint_name(job.step), write_and_publish)


def _publish(root: Path, partial: Path, step: int, keep: int | None) -> None:
    """Rank 0, every file written: rename into place, move latest.json, prune (files.py)."""
    publish(root, partial, step)
    if keep is not None:
        prune(root, keep)


def _scheduler_state(scheduler) -> dict[str, Any] | None:
    """An LR scheduler's state dict, checked JSON-able (lambdas are not saved by torch either)."""
    if scheduler is None:
        return None
    if not (
        hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict") and hasattr(scheduler, "optimizer")
    ):
        raise ConfigError("scheduler", type(scheduler).__name__, "a torch.optim.lr_scheduler scheduler, or None")
    return check_jsonable(scheduler.state_dict(), f"{type(scheduler).__name__}.state_dict()")

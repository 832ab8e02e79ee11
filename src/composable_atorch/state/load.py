"""Resume a training run from what :func:`~composable_atorch.state.save.save_state` wrote.

The order is the guarantee: the directory is verified (every file's size and checksum, the
JSON files' schema, DCP's metadata through an allow-list unpickler; see verify.py), then checked
against the model, optimizer, loader and scheduler, then read by DCP into *fresh* tensors, and
only when every shard has been read is anything copied into the live model and optimizer. A
failed load (a damaged file, a mismatch, DCP failing) therefore leaves the model's weights, the
optimizer's state (not even created when it had none) and the loader as they were. Every failure
is a typed error (ConfigError, or its CheckpointError naming the file).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from composable_atorch.errors import CheckpointError, ConfigError
from composable_atorch.runtime import resumable as _resumable
from composable_atorch.runtime.optim import PlanOptimizer
from composable_atorch.runtime.train_step import runner_of
from composable_atorch.state import inflight, verify, writes
from composable_atorch.state.files import FORMAT, META, VERSION, _pointer_target, latest_checkpoint
from composable_atorch.state.resumed import Resumed
from composable_atorch.state.save import (
    _dcp,
    _distributed,
    _optimizer_shape,
    _rank_world,
    _scheduler_state,
    _single_process_is_intended,
    _split_optimizer,
    _state_optimizer,
    _sync_hyperparameters,
    refuse_expert_parallel,
    restore_hyperparameters,
)
from composable_atorch.transforms.parallel.expert import checkpoint as expert_checkpoint
from composable_atorch.transforms.parallel.tensor import load_layout

__all__ = ["load_state"]

DCP_METADATA = ".metadata"


def _fresh(value: Any) -> Any:
    """An uninitialised tensor like ``value`` (a DTensor stays sharded the same way) for DCP to fill."""
    return torch.empty_like(value) if isinstance(value, torch.Tensor) else value


def _is_stage(optim) -> bool:
    """A pipeline stage holds a subset of the saved model (every stage's ranks wrote their own part): the
    plan's optimizer carries the pipeline's runner."""
    return runner_of(optim) is not None


def _check_model(model: torch.nn.Module, metadata, path: Path, stage: bool) -> dict[str, Any]:
    """The model's state dict; ConfigError when its names or shapes differ from the checkpoint's.

    A pipeline stage may lack the checkpoint's other stages' names (at another pipeline layout
    its stage holds other blocks), never one of its own.
    """
    _, sd, options = _dcp()
    model_sd = sd.get_model_state_dict(model, options=options)
    expert_checkpoint.to_global(model, model_sd)  # split experts as their shard of the whole, at this degree
    saved = {k[len("model.") :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    missing = sorted(set(model_sd) - set(saved))
    unexpected = [] if stage else sorted(set(saved) - set(model_sd))
    shapes = [
        f"{k} {tuple(getattr(saved[k], 'size', ()))} vs {tuple(v.shape)}"
        for k, v in model_sd.items()
        if k in saved and isinstance(v, torch.Tensor) and tuple(getattr(saved[k], "size", v.shape)) != tuple(v.shape)
    ]
    problems = [f"missing from the checkpoint: {', '.join(missing[:5])}"] if missing else []
    problems += [f"not in the model: {', '.join(unexpected[:5])}"] if unexpected else []
    problems += [f"shape (checkpoint vs model): {', '.join(shapes[:5])}"] if shapes else []
    if problems:
        raise ConfigError(
            f"checkpoint {path}",
            type(model).__name__,
            "a model with the same parameter names and shapes as the saved one (" + "; ".join(problems) + ")",
        )
    return model_sd


def _check_optimizer(inner, hooks: list, saved: dict | None, hook_states: list, path: Path, stage: bool) -> None:
    if inner is None:
        return
    if saved is None:
        raise ConfigError(
            f"checkpoint {path}", "no optimizer state", "load_state(..., optim=None) for a checkpoint saved without one"
        )
    mine = _optimizer_shape(inner, hooks)
    # a pipeline stage's groups hold its own stage's parameters: their sizes differ per stage (DCP
    # still reads every one of its parameters' states by name, or fails before anything changes)
    for key in ("class",) if stage else ("class", "group_sizes"):
        if mine[key] != saved[key]:
            raise ConfigError(f"checkpoint {path} optimizer {key}", mine[key], f"{saved[key]!r}, as saved")
    unmatched = _match_hooks(hooks, saved["hooks"], hook_states)[1]
    if unmatched:
        raise ConfigError(
            f"checkpoint {path} optimizer hooks",
            mine["hooks"],
            f"a plan whose optimizer has the saved hooks {saved['hooks']} (state of {unmatched} would be lost)",
        )


def _match_hooks(hooks: list, saved_names: list[str], saved_states: list) -> tuple[list, list[str]]:
    """Pair this optimizer's hooks with saved states by class name (n-th of a kind to n-th).

    Returns (pairs, names of saved hooks with state and no counterpart).
    """
    pool: dict[str, list] = {}
    for name, state in zip(saved_names, saved_states):
        pool.setdefault(name, []).append(state)
    pairs = [(h, pool[type(h).__name__].pop(0)) for h in hooks if pool.get(type(h).__name__)]
    lost = [name for name, states in pool.items() for s in states if s]
    return pairs, lost


def load_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optim=None,
    loader=None,
    *,
    scheduler=None,
    verbose: bool = True,
    exact_resume: bool = False,
) -> Resumed:
    """Load what save_state wrote into ``model``, ``optim`` and ``loader``, in place.

    ``directory`` is the one given to save_state (its latest complete checkpoint is loaded) or
    one ``step-*`` checkpoint inside it. Call it on every rank of any layout and world size (the
    plan of the saving run, another plan, or none in one process: DCP reshards the model and
    optimizer). Everything is verified and checked before anything is modified; a failure
    leaves model, optimizer and loader as they were, and a damaged checkpoint is a
    CheckpointError naming the file and the checkpoint. ``scheduler`` gets the LR scheduler state
    saved with ``save_state(..., scheduler=)``.

    The data position carries over when ``loader`` reads the saved run's sample order (the same
    plan, at any world size). A loader reading another order (a plain shuffling DataLoader in one
    process, to evaluate or fine-tune) cannot continue it: the weights, optimizer and scheduler
    still load, the loader is left as given, and the result says so (``.data_position``,
    ``.explain()``); ``exact_resume=True`` makes that a ConfigError instead. With ``verbose``
    rank 0 prints the step it resumes at and what became of the data position.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    refuse_expert_parallel(model, "load_state")
    inflight.wait_for_saves()  # a save of this process still being written is published first
    path = None
    try:
        path = _checkpoint_to_load(directory)
        return _load(path, model, optim, loader, scheduler, verbose, exact_resume)
    except CheckpointError as exc:  # name the checkpoint directory (and its step) beside the file
        raise _named(exc, path, directory) from None


def _named(exc: CheckpointError, path: Path | None, directory) -> CheckpointError:
    """``exc`` saying which checkpoint (directory, step) the damaged file belongs to, and that nothing loaded."""
    if getattr(exc, "checkpoint", None) is not None:
        return exc
    checkpoint = Path(path) if path is not None else Path(exc.path).parent
    match = re.fullmatch(r"step-(\d{8})(\.resaved)?", checkpoint.name)
    where = f"checkpoint {checkpoint}" + (f" (step {int(match.group(1))})" if match else "")
    if Path(directory) != checkpoint:
        where += f", the one to load from {directory}"
    named = CheckpointError(exc.path, f"{exc.problem}; in {where}; nothing was loaded", exc.fix)
    named.checkpoint = str(checkpoint)
    return named


def _checkpoint_to_load(directory: str | os.PathLike) -> Path:
    """The checkpoint latest_checkpoint picks; when none is complete, the error names what is wrong.

    A damaged newest checkpoint with an older complete one beside it loads the older one (a crash
    between two renames of a re-save looks the same) and warns, naming the damaged file.
    """
    root = Path(directory)
    path = latest_checkpoint(root)
    candidate = _newest_candidate(root)
    if path is None and candidate is not None:
        try:
            _verify(candidate)
        except CheckpointError as exc:  # the damaged or missing file, in the checkpoint it belongs to
            raise _named(exc, candidate, directory) from None
    if path is None:
        if root.is_file():
            problem = "a file, not a checkpoint directory"
        elif not root.exists():
            problem = "does not exist"
        else:
            problem = "holds no latest.json nor step-* checkpoint (not written by save_state)"
        raise ConfigError(
            "load_state directory",
            f"{directory} ({problem})",
            "a directory written by save_state (holding latest.json) or one of its step-* checkpoints",
        )
    if candidate is not None and candidate != path and candidate.name > path.name:
        try:
            _verify(candidate)
        except CheckpointError as exc:
            warnings.warn(
                f"composable_atorch: the newest checkpoint {candidate} is damaged ({exc.path}: {exc.problem}); "
                f"loading the newest complete one, {path.name}",
                stacklevel=3,
            )
    return path


def _newest_candidate(root: Path) -> Path | None:
    """The step directory a load would want: the one latest.json names, else the newest by name."""
    if (root / META).exists():
        return root
    if not root.is_dir():
        return None
    named = _pointer_target(root)
    if named is not None and named.is_dir():
        return named
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    return steps[-1] if steps else None


def _verify(path: Path) -> dict[str, Any]:
    meta = verify.read_meta(path / META, FORMAT, VERSION)
    verify.verify_files(path, meta[verify.FILES])
    return meta


def _load(path: Path, model, optim, loader, scheduler, verbose: bool, exact_resume: bool) -> Resumed:
    meta = _verify(path)  # every byte, before anything else is read
    files = meta[verify.FILES]
    inner, hooks, _ = _split_optimizer(optim)
    rank, world = _rank_world()
    same_world = meta["world_size"] == world
    for name in (f"rank-{rank if same_world else 0}.json", DCP_METADATA):
        if name not in files:
            raise CheckpointError(path / name, "not among the files checkpoint.json lists")
    rank_state = verify.read_rank_state(path / f"rank-{rank if same_world else 0}.json")
    dcp, sd, options = _dcp()
    reader = verify.safe_reader(path, files)
    metadata = reader.read_metadata()
    model_sd = _check_model(model, metadata, path, _is_stage(optim))
    _check_optimizer(inner, hooks, meta["optimizer"], rank_state["hooks"], path, _is_stage(optim))
    if meta["micro_step"] and not same_world:
        raise ConfigError(
            f"checkpoint {path}",
            f"saved mid accumulation window at world {meta['world_size']}",
            f"world {meta['world_size']}: unsynchronised per-rank gradients cannot be resharded",
        )
    if scheduler is not None:
        _scheduler_state(scheduler)  # the type check
        if meta.get("scheduler") is None:
            raise ConfigError(
                f"checkpoint {path}",
                "no LR scheduler state",
                "load_state(..., scheduler=None) for a checkpoint saved without one",
            )
    # the data position must fit this loader before anything changes (or is left out, and said so)
    carried, position_note = _plan_data_position(loader, meta, rank_state, exact_resume, path)

    # -- checked: read everything into fresh tensors ---------------------------------------------
    saved_optim = inner is not None and meta["optimizer"]["has_state"]
    local = None if inner is None else _state_optimizer(inner)
    created = saved_optim and not local.state
    try:
        state = _read(path, model, model_sd, local if saved_optim else None, metadata, reader, meta, rank)
    except BaseException:
        if created:  # DCP's template needed the optimizer's state: the failed load leaves none behind
            local.state.clear()
        raise

    # -- every shard read: copy into the live model and optimizer --------------------------------
    if saved_optim:
        sd.set_state_dict(
            model, [local], model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        _sync_hyperparameters(inner, local)
    else:
        sd.set_model_state_dict(model, state["model"], options=options)
        if local is not None:
            local.state.clear()
            # a stateless optimizer (SGD without momentum): DCP had no state to carry its groups' LR
            restore_hyperparameters(inner, meta["optimizer"].get("hyperparameters"))
    if meta["micro_step"]:
        _restore_grads(model, state["grads"], rank)
    for hook, hook_state in _match_hooks(
        hooks, meta["optimizer"]["hooks"] if meta["optimizer"] else [], rank_state["hooks"]
    )[0]:
        hook.load_state_dict(hook_state)
    if isinstance(optim, PlanOptimizer):
        optim.micro_step = rank_state["micro_step"]
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if verbose and rank == 0:
        _say_resumed(path, meta, carried, position_note)
    if carried:
        rng = rank_state["rng"] if same_world else None
        _resumable.resumable(loader).resume_at(rank_state["loader"], rng=rng, replay=same_world)
    elif same_world:
        _resumable.restore_rng(rank_state["rng"])
    return Resumed.of(
        meta["step"],
        meta["extra"],
        checkpoint=str(path),
        data_position_carried=carried,
        data_position=position_note,
        rng_restored=same_world,
    )


def _plan_data_position(loader, meta: dict, rank_state: dict, exact: bool, path: Path) -> tuple[bool, str]:
    """(carried over, what happens), checked before anything changes.

    A loader that reads another sample order is left as given (ConfigError with ``exact``); one
    of the saved order whose batches cannot continue the position is a ConfigError either way:
    that user meant to resume the run (see resumable.other_order).
    """
    if loader is None:
        if exact and meta["loader"]:
            raise ConfigError(
                "load_state loader", None, "the run's loader, to continue its data position (exact_resume=True)"
            )
        return False, "no loader given"
    saved = rank_state["loader"] if meta["loader"] else None
    reason = _resumable.other_order(loader, saved)
    if reason is not None:
        if exact:
            raise ConfigError(
                f"checkpoint {path} data position (exact_resume=True)",
                reason,
                "a loader reading the saved order (the saving run's plan, applied under a process group: torchrun or "
                "composable_atorch launch, at any world size); or exact_resume=False to load the weights, optimizer "
                "and scheduler and start the loader's epoch anew",
            )
        return False, f"{reason}; the loader was left as given (its epoch starts anew)"
    batches = _resumable.resume_batches(loader, saved)
    note = f"skipping the {batches} batch(es) of epoch {saved['epoch']} already seen"
    if "samples" in saved:
        note += f" ({saved['samples']} samples of the global order)"
    return True, note


def _say_resumed(path: Path, meta: dict[str, Any], carried: bool, note: str) -> None:
    """One line for the user: which step, and what became of the data position."""
    line = f"composable_atorch: resumed from {path.name} at step {meta['step']}"
    if carried:
        line += f"; {note}"
    elif note != "no loader given":
        line += f"; the data position did NOT carry over: {note}"
    print(line, flush=True)


def _read(path: Path, model, model_sd: dict, local, metadata, reader, meta: dict, rank: int) -> dict[str, Any]:
    """The checkpoint's state in fresh tensors shaped like the live ones (the live ones untouched)."""
    from torch.distributed.checkpoint.api import CheckpointException

    dcp, sd, options = _dcp()
    state: dict[str, Any] = {"model": {k: _fresh(v) for k, v in model_sd.items()}}
    if local is not None:  # the template: the optimizer's state (created if it has none yet), copied
        state["optim"] = {k: _fresh(v) for k, v in sd.get_optimizer_state_dict(model, [local], options=options).items()}
        expert_checkpoint.to_global(model, None, state["optim"], fresh=True)
    if meta["micro_step"]:
        saved_keys = metadata.state_dict_metadata
        state["grads"] = {
            f"rank{rank}.{name}": torch.zeros_like(p.to_local() if hasattr(p, "to_local") else p)
            for name, p in model.named_parameters()
            if f"grads.rank{rank}.{name}" in saved_keys
        }
    loading, finish_layout = load_layout(model, state)  # fused (strided) tensor-parallel layers
    try:
        with _single_process_is_intended():
            dcp.load(loading, storage_reader=reader, planner=verify.safe_planner(), no_dist=not _distributed())
    except CheckpointException as exc:  # a BaseException: never let it pass `except Exception`
        raise CheckpointError(path, f"DCP could not read it ({_first_failure(exc)})") from None
    except (RuntimeError, ValueError, OSError, EOFError, KeyError) as exc:
        raise CheckpointError(path, f"DCP could not read it ({type(exc).__name__}: {exc})") from None
    finish_layout()
    expert_checkpoint.to_local(model, state["model"], state.get("optim"))
    return state


def _first_failure(exc) -> str:
    """The first failing rank's exception (DCP pairs each with its traceback) as one line."""
    first = writes.dcp_failures(exc)[0]
    return f"rank {first.rank}: {first.text[:300]}"


def _restore_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor], rank: int) -> None:
    for name, p in model.named_parameters():
        grad = grads.get(f"rank{rank}.{name}")
        if grad is None:
            p.grad = None
        elif hasattr(p, "to_local"):
            from torch.distributed.tensor import DTensor

            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = grad

"""What one rank of a trial does, inside a fresh process: build, apply the plan, train, measure.

The parent (:mod:`.trial`) starts ``world`` of these with multiprocessing's *spawn* context, so
factories defined in the user's ``__main__`` resolve as they do for any spawned worker. Each rank
starts its own session (``os.setsid``) so the parent can kill it and anything it started with one
``killpg``, and asks the kernel to kill it if the parent dies (``PR_SET_PDEATHSIG``): a trial never
leaves a process behind.

Every plan trains through :func:`composable_atorch.train_step`, the one documented call that trains
pipeline plans too (:func:`trial_step` here adds accumulation windows and the sample record).

Peak memory per rank: on CUDA ``torch.cuda.max_memory_allocated`` over one training step; on the
CPU torch's ``MemTracker`` (torch.distributed._tools) over one training step, with the model's
parameters, buffers and the optimizer's state registered before the step — the peak bytes of
every tensor storage the plan holds (parameters, gradients, optimizer state, activations,
temporaries). Process RSS is not used: on this machine it got the direction wrong. The measured
step's batches are fetched before the tracker starts (:func:`prefetch`): the input batch is not the
plan's cost.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from composable_atorch.auto.workload import Workload

#: Environment variables of an enclosing torchrun that must not leak into a trial's own group.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_", "TORCH_ELASTIC")


@dataclass(frozen=True)
class RankSpec:
    """One trial as the ranks see it (picklable; the plan travels as JSON)."""

    plan_json: str
    workload: Workload
    world_size: int
    out_dir: str
    init_file: str
    mode: str = "measure"  # or "train"
    warmup_steps: int = 2
    measure_steps: int = 4
    train_steps: int = 0
    measure_memory: bool = True
    timeout: float = 120.0
    precision: float | None = None  # see TrialSettings: measure on until the figure is this precise
    max_measure_steps: int = 40
    max_measure_s: float = 20.0
    #: the plan's classes and functions as objects (pickled by reference with the workload): the plan
    #: is the parent's own, so its names resolve against these, not the allow-list (core.codec)
    trusted: tuple = ()


def batches(loader) -> Iterator[Any]:
    """Endless iteration over the loader, advancing a distributed sampler's epoch."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def to_device(batch, device):
    import torch

    if device == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def tokens_per_sample(batch) -> int | None:
    """Tokens in one sample when the batch's first tensor holds token ids ``(batch, seq...)``."""
    import torch

    first = batch
    while isinstance(first, list | tuple) and first:
        first = first[0]
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and first.dim() >= 2:
        return first[0].numel()
    return None


def sample_ids(batch) -> list[str] | None:
    """One short digest per sample of the batch (its rows of every tensor with the batch's leading
    dimension), so the parent can count each sample once across ranks; None if the batch holds no
    tensor to tell samples apart by."""
    import hashlib

    import torch

    leaves: list[torch.Tensor] = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            leaves.append(value)
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k])
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk(batch)
    leaves = [t for t in leaves if t.dim() >= 1]
    if not leaves:
        return None
    n = leaves[0].shape[0]
    rows = [t.detach().cpu().contiguous() for t in leaves if t.shape[0] == n]
    out = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=8)
        for t in rows:
            h.update(t[i].reshape(-1).view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


class WholeBatch:
    """``loss_fn(model, batch)`` in the shape :func:`composable_atorch.train_step` takes: called on the
    batch as the "model", it returns the loss as the "output" (:func:`loss_of_output` passes it on)."""

    def __init__(self, model, loss_fn):
        self.model, self.loss_fn = model, loss_fn

    def __getattr__(self, name):  # what train_step reads off the model (e.g. its loss group) is the model's
        if name in ("model", "loss_fn"):
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, batch):
        loss = self.loss_fn(self.model, batch)
        return loss[0] if isinstance(loss, list | tuple) else loss


def loss_of_output(output, _targets):
    """The loss :class:`WholeBatch` computed already."""
    return output


def stage_needs_criterion(optim) -> str | None:
    """Why the plan's model cannot train through ``loss_fn(model, batch)``: its optimizer carries a pipeline runner."""
    from composable_atorch.runtime.train_step import runner_of

    if runner_of(optim) is None:
        return None
    return (
        "this plan is a pipeline: its loss runs inside the schedule on the last stage's output, so it needs "
        "Workload.criterion(output, targets) and a loader of (inputs, targets) batches"
    )


def step_call(model, batch, loss_fn, criterion) -> tuple[Any, Any, Any, Any]:
    """``(model, inputs, targets, loss_fn)`` for :func:`composable_atorch.train_step` on one batch."""
    if criterion is not None:
        inputs, targets = batch
        return model, inputs, targets, criterion
    return WholeBatch(model, loss_fn), batch, None, loss_of_output


def trial_step(
    model, optim, data: Iterator, loss_fn, device: str, before_micro=None, seen: list | None = None, *, criterion=None
) -> tuple[float, Any]:
    """One optimizer step through :func:`composable_atorch.train_step` (the call that trains every plan):
    as many micro-batches as the plan's accumulation asks for (each batch this rank consumed is
    appended to ``seen`` when given). Returns the step's mean loss and its last batch."""
    from composable_atorch.runtime.train_step import train_step as one_step

    micro = int(getattr(optim, "accumulation_steps", 1))
    total, batch = 0.0, None
    for _ in range(micro):
        if before_micro is not None:
            before_micro()
        batch = to_device(next(data), device)
        if seen is not None:
            seen.append(batch)
        target_model, inputs, targets, fn = step_call(model, batch, loss_fn, criterion)
        total += float(one_step(target_model, optim, inputs, targets, fn))
    return total / micro, batch


def prefetch(optim, data: Iterator, device: str) -> list:
    """The next optimizer step's micro-batches, fetched and on ``device``: the measured step runs on
    these (``trial_step(..., iter(prefetch(...)), ...)``) so the tracker sees forward, backward and
    step only. A batch fetched inside the tracked step is a new view of the dataset's storage (a
    TextDataset slices one corpus tensor), which torch's MemTracker counts whole, as an activation;
    the estimate leaves the input batch out too."""
    return [to_device(next(data), device) for _ in range(int(getattr(optim, "accumulation_steps", 1)))]


def _batch_len(batch) -> int:
    import torch

    while isinstance(batch, list | tuple | dict) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.dim() >= 1 else 1


def peak_bytes_of_step(step: Callable[..., Any], model, optim, device: str) -> tuple[int, str]:
    """Peak bytes of one training step on this rank, and how they were measured (see module doc)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated over one step"
    from composable_atorch.estimate.simulate import frozen_safe_tracker, per_call_stats
    from composable_atorch.runtime.train_step import runner_of

    tracker = frozen_safe_tracker()  # the estimate's tracker: LoRA's frozen base weights would make MemTracker raise
    inner = getattr(optim, "optimizer", optim)
    tracker.track_external(model, inner)
    # a pipeline schedule calls its stage once per micro-batch inside one step: per-module stats are
    # reset before each call (per_call_stats); the global peak survives resets, as between
    # accumulation micro-batches
    with per_call_stats(tracker, model if runner_of(optim) is not None else None), tracker:
        step(before_micro=tracker.reset_mod_stats)
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(int(snap.get("Total", 0)) for snap in peak.values())
    return (
        total,
        "torch MemTracker peak over one step (parameters, gradients, optimizer state, activations, temporaries)",
    )


def _isolate() -> None:
    os.setsid()  # own session and process group: the parent kills us and our children with killpg
    with contextlib.suppress(Exception):  # Linux only: die with the parent
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def classify(exc: BaseException) -> str:
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return "out of memory"
    return "crash"


def rank_main(rank: int, spec: RankSpec, progress=None) -> None:
    """Entry point of one rank (a spawned process)."""
    _isolate()
    _redirect_output(os.path.join(spec.out_dir, f"rank{rank}.log"))
    for key in [k for k in os.environ if k.startswith(_LAUNCHER_PREFIXES)]:
        del os.environ[key]
    world = spec.world_size
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
    )
    result_path = os.path.join(spec.out_dir, f"rank{rank}.json")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"file://{spec.init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=max(30.0, spec.timeout)),
        )
        out = _run(rank, spec, device, progress)
        _write(result_path, {"status": "ok", **out})
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the trial's reason
        _write(
            result_path,
            {
                "status": "error",
                "kind": classify(exc),
                "reason": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            },
        )
        os._exit(1)  # do not wait in collectives or atexit handlers of a broken group
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    os._exit(0)


def relative_error(step_times: list[float]) -> float | None:
    """The relative standard error of the mean step, ``std / sqrt(n) / mean``: how far the trial's
    figure may be from a long run's (None with fewer than 2 steps)."""
    import statistics

    if len(step_times) < 2:
        return None
    mean = statistics.fmean(step_times)
    return statistics.stdev(step_times) / (len(step_times) ** 0.5) / mean if mean > 0 else None


def _measure_more(spec: RankSpec, step_times: list[float], spent: float) -> bool:
    """Whether to time one more step: rank 0 decides (its figure is the trial's) and tells the others,
    so every rank runs the same number of steps (the collectives inside a step must match)."""
    import torch
    import torch.distributed as dist

    if spec.precision is None:
        return False
    # a trial may spend at most a third of its time limit on timed steps: the rest is spawn, build, warm-up
    budget = min(spec.max_measure_s, spec.timeout / 3)
    error = relative_error(step_times)
    more = len(step_times) < spec.max_measure_steps and spent < budget and (error is None or error > spec.precision)
    flag = torch.tensor([1.0 if more else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def _run(rank: int, spec: RankSpec, device: str, progress) -> dict:
    import torch.distributed as dist

    from composable_atorch.auto.space import sequence_split
    from composable_atorch.core.plan import Plan

    model, optim, loader = spec.workload.build()
    if device == "cuda":
        model = model.to(device)
    plan = Plan.from_json(spec.plan_json, allow=spec.trusted)  # composed again here: checked against this very process
    model, optim, loader = plan(model, optim, loader)
    data = batches(loader)
    loss_fn, criterion = spec.workload.loss_fn, spec.workload.criterion
    if criterion is None and (why := stage_needs_criterion(optim)):
        from composable_atorch.errors import ConfigError

        raise ConfigError("Workload.criterion", None, why)
    if spec.mode == "train":
        losses = []
        for i in range(spec.train_steps):
            loss, _ = trial_step(model, optim, data, loss_fn, device, criterion=criterion)
            losses.append(loss)
            if progress is not None and rank == 0:
                progress.put((i + 1, loss))
        return {"losses": losses}
    losses, batch = [], None
    for _ in range(spec.warmup_steps):
        loss, batch = trial_step(model, optim, data, loss_fn, device, criterion=criterion)
        losses.append(loss)
    dist.barrier()
    start = time.perf_counter()
    step_times, consumed = [], []
    while len(step_times) < spec.measure_steps or _measure_more(spec, step_times, time.perf_counter() - start):
        t0 = time.perf_counter()
        consumed.append([])
        loss, batch = trial_step(
            model, optim, data, loss_fn, device, seen=consumed[-1], criterion=criterion
        )  # .item() inside: the step is done
        step_times.append(time.perf_counter() - t0)
        losses.append(loss)
    dist.barrier()
    elapsed = time.perf_counter() - start
    # after the clock: what this rank trained on, sample by sample, per measured step
    per_step = [[sample_ids(b) for b in step] for step in consumed]
    ids = (
        None
        if any(got is None for step in per_step for got in step)
        else [[i for got in step for i in got] for step in per_step]
    )
    peak, method = None, None
    if spec.measure_memory:
        fetched = prefetch(optim, data, device)  # before the tracker: it measures forward/backward/step only

        def step(before_micro=None):
            return trial_step(model, optim, iter(fetched), loss_fn, device, before_micro, criterion=criterion)

        peak, method = peak_bytes_of_step(step, model, optim, device)
    return {
        "elapsed": elapsed,
        "steps": len(step_times),
        "relative_error": relative_error(step_times),
        "step_times": step_times,
        "losses": losses,
        "peak_bytes": peak,
        "memory_method": method,
        "tokens_per_sample": tokens_per_sample(batch),
        "sample_ids": ids,
        "sequence_split": sequence_split(plan),
        "samples_consumed": sum(_batch_len(b) for step in consumed for b in step),
        "applied": plan.explain(),
    }

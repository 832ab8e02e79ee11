"""Pre-flight: train the user's workload once, with no plan, in this process, before any trial.

A model that cannot consume the batch, a loss that does not return a tensor, a dataset that cannot
be batched: every plan of the study would crash the same way, and the search would burn its whole
budget finding that out. :func:`preflight` runs one optimizer step of the workload as given (world
1, no transform) and raises :class:`~composable_atorch.errors.WorkloadError` naming the part that
failed and what to set. Running out of memory is not such an error (a plan may fix it: sharding,
checkpointing), so it is reported back, not raised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from composable_atorch.auto.workload import Workload, make_optimizer
from composable_atorch.errors import WorkloadError


@dataclass(frozen=True)
class PreflightResult:
    ok: bool
    seconds: float
    #: why the step did not finish when a plan might still fix it (out of memory)
    note: str | None = None


def _describe(batch) -> str:
    if isinstance(batch, dict):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, list | tuple):
        return f"a {type(batch).__name__} of {len(batch)}"
    return type(batch).__name__


def loss_hint(batch, exc: BaseException) -> str:
    """What to set when ``loss_fn(model, batch)`` fails on the plain model (names the argument)."""
    shape = _describe(batch)
    if isinstance(batch, dict):
        return (
            f"the loader yields {shape}; a model whose forward takes those as keyword arguments needs the batch "
            "unpacked: set model_input_format='unpack_dict' in auto_accelerate, or call model(**batch) in loss_fn"
        )
    if isinstance(batch, list | tuple) and isinstance(exc, TypeError | ValueError | AttributeError):
        return (
            f"the loader yields {shape}; a model whose forward takes those as positional arguments needs the batch "
            "unpacked: set model_input_format='unpack_sequence' in auto_accelerate, or call model(*batch) in "
            "loss_fn; or pass prepare_input to pick the model's input"
        )
    return (
        f"make loss_fn(model, batch) run on one batch of the dataset ({shape}) in a single process, without any "
        "plan; check the model's forward signature, prepare_input and loss_func"
    )


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def _fail(part: str, exc: BaseException, hint: str) -> WorkloadError:
    err = WorkloadError(part, exc, hint)
    err.__cause__ = exc
    return err


def preflight(workload: Workload) -> PreflightResult:
    """One optimizer step of ``workload`` as given; :class:`WorkloadError` when it cannot run at all."""
    import torch
    from torch.utils.data import DataLoader

    start = time.monotonic()
    torch.manual_seed(workload.seed)
    try:
        stage, hint = "model_fn()", "model_fn must build the model with no arguments"
        model = workload.model_fn()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"returned {type(model).__name__}, not a torch.nn.Module")
        stage, hint = (
            "optim_fn(model)",
            "optim_fn must take the model (or be an optimizer class) and return a torch optimizer",
        )
        optim = make_optimizer(workload.optim_fn, model)
        stage, hint = (
            "the data loader",
            (
                "the dataset must batch with torch's DataLoader at batch_size; check "
                "dataloader_args / loader_kwargs and the dataset's __getitem__"
            ),
        )
        kwargs = {"drop_last": True, **workload.loader_kwargs, "shuffle": False}
        kwargs.pop("generator", None)
        batch = next(iter(DataLoader(workload.dataset, batch_size=workload.batch_size, **kwargs)))
    except StopIteration:
        raise WorkloadError(
            "the data loader", "no full batch", f"give a dataset of at least batch_size={workload.batch_size} samples"
        ) from None
    except Exception as exc:  # noqa: BLE001 - every failure of the user's own code becomes the error
        if out_of_memory(exc):
            return PreflightResult(False, time.monotonic() - start, f"out of memory in {stage}: {exc}")
        raise _fail(stage, exc, hint) from exc
    try:
        loss = workload.loss_fn(model, batch)
        if isinstance(loss, list | tuple) and loss:
            loss = loss[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            what = (
                type(loss).__name__
                if not isinstance(loss, torch.Tensor)
                else f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
            )
            raise WorkloadError(
                "loss_fn(model, batch)",
                f"returned {what}",
                "return the scalar loss tensor of the batch (or a tuple whose first item it is)",
            )
    except WorkloadError:
        raise
    except Exception as exc:  # noqa: BLE001
        if out_of_memory(exc):
            return PreflightResult(False, time.monotonic() - start, f"out of memory in the forward: {exc}")
        raise _fail("loss_fn(model, batch)", exc, loss_hint(batch, exc)) from exc
    try:
        loss.backward()
        optim.step()
        optim.zero_grad()
    except Exception as exc:  # noqa: BLE001
        if out_of_memory(exc):
            return PreflightResult(False, time.monotonic() - start, f"out of memory in the backward: {exc}")
        raise _fail(
            "the backward pass and optimizer step",
            exc,
            "check the loss depends on the model's parameters and the optimizer holds them",
        ) from exc
    return PreflightResult(True, time.monotonic() - start)

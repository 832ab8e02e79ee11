"""Checking what estimate() is given, before any work: the model, the batch, the world size.

Bad input is a typed error naming the fix (``EstimateError`` for a model that cannot live on the
meta device, ``ConfigError`` for a batch with no shapes or a world size the plan cannot use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from composable_atorch.errors import CompositionError, ConfigError


class EstimateError(CompositionError):
    """The estimate cannot simulate this input (names what failed and the fix)."""

    def __init__(self, what: str, error: BaseException | str, fix: str):
        self.what, self.fix = what, fix
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"{what} ({self.error}). Fix: {fix}.")


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", world_size, "a positive int: the number of ranks the plan will run on")
    return world_size


def meta_model(model: Any) -> torch.nn.Module:
    """The model to simulate: a module (any device; only shapes are read) or a factory called on the
    meta device. A factory that fails there is an EstimateError naming the fix."""
    if isinstance(model, torch.nn.Module):
        return model
    if callable(model):
        try:
            with torch.device("meta"):
                built = model()
        except Exception as exc:  # noqa: BLE001 - any failure means it cannot be built on meta
            raise EstimateError(
                "the model cannot be built on the meta device",
                exc,
                "build it without reading tensor values in __init__ (no .item(), no loading weights), e.g. "
                "`with torch.device('meta'): model = MyModel(config)`, or under record_module_init(); "
                "load weights after the estimate",
            ) from exc
        if not isinstance(built, torch.nn.Module):
            raise ConfigError("model", type(built).__name__, "a torch.nn.Module or a function returning one")
        return built
    raise ConfigError(
        "model", type(model).__name__, "a torch.nn.Module on the meta device, or a function that builds one"
    )


def _shape_leaf(value: Any) -> bool:
    return isinstance(value, torch.Size) or (
        isinstance(value, tuple) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def leaves(batch: Any) -> list[Any]:
    """The tensors (or shapes) of a batch, in order."""
    if isinstance(batch, torch.Tensor) or _shape_leaf(batch):
        return [batch]
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in leaves(v)]
    if isinstance(batch, list | tuple):
        return [x for v in batch for x in leaves(v)]
    return []


def check_batch(batch: Any) -> int:
    """The global batch size (leading dim of the batch's first tensor); ConfigError for no shapes."""
    found = [x for x in leaves(batch) if (len(x) if not isinstance(x, torch.Tensor) else x.dim()) >= 1]
    if not found:
        raise ConfigError(
            "batch",
            type(batch).__name__,
            "a sample batch as the loader yields it (the global batch), or its shapes: tensors (meta is fine) or "
            "torch.Size, e.g. (torch.Size([16, 128]), torch.Size([16, 128])) for (tokens, targets)",
        )
    first = found[0]
    return int(first.shape[0] if isinstance(first, torch.Tensor) else first[0])


def fake_batch(batch: Any, global_batch: int, micro: int) -> Any:
    """The batch one rank feeds one micro-step, as fresh tensors (call under FakeTensorMode): the
    leading dim cut from the global batch to ``micro`` where it is the global batch. A shape stands
    for token ids (int64)."""
    if isinstance(batch, torch.Tensor) or _shape_leaf(batch):
        shape = list(batch.shape if isinstance(batch, torch.Tensor) else batch)
        dtype = batch.dtype if isinstance(batch, torch.Tensor) else torch.long
        if shape and shape[0] == global_batch:
            shape[0] = micro
        return torch.zeros(shape, dtype=dtype) if not dtype.is_floating_point else torch.empty(shape, dtype=dtype)
    if isinstance(batch, dict):
        return {k: fake_batch(v, global_batch, micro) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(fake_batch(v, global_batch, micro) for v in batch)
    return batch


def rebatched(batch: Any, rows: int, new: int) -> Any:
    """The batch with its leading dim ``rows`` (the global batch) made ``new``, as shapes (meta tensors
    for tensors given)."""
    if isinstance(batch, torch.Tensor) or _shape_leaf(batch):
        shape = list(batch.shape if isinstance(batch, torch.Tensor) else batch)
        if shape and shape[0] == rows:
            shape[0] = new
        return (
            torch.empty(shape, dtype=batch.dtype, device="meta")
            if isinstance(batch, torch.Tensor)
            else torch.Size(shape)
        )
    if isinstance(batch, dict):
        return {k: rebatched(v, rows, new) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(rebatched(v, rows, new) for v in batch)
    return batch


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss when none is given: an HF-style output's ``.loss`` (dict batches are passed as
    keywords), or next-token cross-entropy for ``(inputs, targets)``."""
    if isinstance(batch, dict):
        out = model(**batch)
        return out.loss if hasattr(out, "loss") else out["loss"]
    if isinstance(batch, list | tuple) and len(batch) == 2:
        out = model(batch[0])
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))
    out = model(batch)
    return out.loss if hasattr(out, "loss") else out.float().mean()


def materialize(model: torch.nn.Module) -> None:
    """Replace every parameter and buffer by a fake CPU tensor of the same shape and dtype (call under
    FakeTensorMode), keeping ties (one fake tensor per original)."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, as_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    memo[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if as_param else new
                table[name] = memo[id(t)]


def make_optimizer(optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """None (AdamW), an optimizer class, or ``f(model) -> optimizer`` (as the search's Workload)."""
    if optimizer is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    if callable(optimizer):
        return optimizer(model)
    raise ConfigError(
        "optimizer", type(optimizer).__name__, "None (AdamW), an optimizer class, or a function model -> optimizer"
    )


LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

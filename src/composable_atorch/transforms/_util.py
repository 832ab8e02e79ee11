"""Small helpers shared by transform families: dtype names, module matching, output casting."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from composable_atorch.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    torch.bfloat16: "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    torch.float16: "fp16",
}


def dtype_name(value: Any, field: str) -> str:
    """Normalize 'bf16' / 'bfloat16' / torch.bfloat16 (and fp16 spellings) to 'bf16' or 'fp16'."""
    try:
        return _DTYPE_ALIASES[value]
    except (KeyError, TypeError):
        raise ConfigError(field, value, "'bf16', 'fp16', torch.bfloat16 or torch.float16") from None


def is_function(value: Any) -> bool:
    """A function (or other callable object) where one is expected: a class is not one, since a
    plan naming, say, ``subprocess.Popen`` as a batch function would start a process when called."""
    return callable(value) and not isinstance(value, type)


def is_block_target(value: Any) -> bool:
    """What module matching accepts: an ``nn.Module`` subclass, or a class or module name."""
    return isinstance(value, str) or (isinstance(value, type) and issubclass(value, nn.Module))


def matches(module: nn.Module, qualname: str, targets: tuple) -> bool:
    """A module matches a target class, a class name, or its own qualified name."""
    for t in targets:
        if isinstance(t, type):
            if isinstance(module, t):
                return True
        elif t == type(module).__name__ or t == qualname:
            return True
    return False


def outermost_matches(model: nn.Module, targets: tuple) -> list[tuple[str, nn.Module]]:
    """Modules matching ``targets``, skipping any nested inside an earlier match."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            continue
        if matches(module, name, targets):
            found.append((name, module))
    return found


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors inside (nested) tuples, lists and dicts; everything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, Mapping):
        if type(value) is not dict and hasattr(value, "__setitem__"):
            # ModelOutput-style mappings keep their type (and attribute access)
            for k in list(value.keys()):
                value[k] = cast_floats(value[k], dtype)
            return value
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floats(v, dtype) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(cast_floats(v, dtype) for v in value)
    return value


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def cast_module_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` as torch's ``Module._apply`` does it for real tensors: floating parameters
    (and their gradients) re-pointed in place with ``.data``, so every Parameter object stays the one
    the optimizer holds; floating buffers replaced. Written out because on fake tensors (the estimate's
    simulated world) ``_apply`` swaps instead, and the weakref FakeTensorMode keeps on each Parameter
    makes the swap fail ("Couldn't swap Embedding.weight"): ``half`` could not be estimated."""
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    if p.grad is not None:
                        p.grad = p.grad.to(dtype)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[name] = b.to(dtype)
    return model

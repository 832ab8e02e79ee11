"""``atorch.common.util_func``: the helpers ATorch's examples import."""

from __future__ import annotations

import torch

from composable_atorch.compat.request import default_prepare_input
from composable_atorch.errors import ConfigError


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` when it divides exactly; a ConfigError otherwise (ATorch asserts)."""
    if denominator == 0 or numerator % denominator:
        raise ConfigError("divide", (numerator, denominator), f"a numerator divisible by {denominator}")
    return numerator // denominator


def data_to_device(data, device, non_blocking=False):
    """Tensors in nested lists / tuples / dicts moved to ``device``."""
    return default_prepare_input(data, device)


def data_float_to_dtype(data, dtype):
    """Floating-point tensors in nested lists / tuples / dicts cast to ``dtype``."""
    if torch.is_tensor(data):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, dict):
        return type(data)({k: data_float_to_dtype(v, dtype) for k, v in data.items()})
    if isinstance(data, list | tuple):
        return type(data)(data_float_to_dtype(v, dtype) for v in data)
    return data


__all__ = ["data_float_to_dtype", "data_to_device", "divide"]

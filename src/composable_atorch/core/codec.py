"""Config values <-> JSON values. Never pickle: classes travel as import paths.

Encoded forms: JSON scalars as they are; lists for tuples and lists (decoded as tuples, since
configs are frozen); objects for dicts; ``{"$dtype": "bfloat16"}`` for torch dtypes;
``{"$class": "package.module:Qual.Name"}`` for classes, resolved by import on load.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from composable_atorch.errors import ConfigError

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def class_path(cls: type) -> str:
    if "<locals>" in cls.__qualname__:
        raise ConfigError(
            "class", cls, "a module-level class (importable by path) or its name as a string, to be saved as JSON"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_class(path: str) -> type:
    module, _, qual = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("class path", path, f"an importable 'module:QualName' ({exc})") from None
    if not isinstance(obj, type):
        raise ConfigError("class path", path, "a path naming a class")
    return obj


def encode(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        return {"$class": class_path(value)}
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError("config key", bad[0], "string keys only, to be saved as JSON")
        return {k: encode(v) for k, v in value.items()}
    raise ConfigError("config value", value, "JSON scalars, tuples, dicts, torch dtypes or classes")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(decode(v) for v in value)
    if isinstance(value, dict):
        if "$dtype" in value:
            if value["$dtype"] not in _DTYPES:
                raise ConfigError("$dtype", value["$dtype"], ", ".join(_DTYPES))
            return _DTYPES[value["$dtype"]]
        if "$class" in value:
            return resolve_class(value["$class"])
        return {k: decode(v) for k, v in value.items()}
    return value

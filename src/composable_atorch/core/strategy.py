"""Strategies as data: ATorch's list form, JSON text or files, and Plans — never pickle.

``load`` accepts

* a :class:`Plan` (returned as it is);
* ATorch's list form: ``["parallel_mode", ("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", (Block,))]``;
* a JSON string (a saved plan, or the list form with JSON-encoded configs), or bytes of one;
* a path to a ``.json`` file (a regular file of at most 16 MiB).

A plan is data: loading one never imports a module or runs code. A class or function it names
(``{"$class": "mymodel:Block"}``) resolves only against ``allow=[...]``, objects registered with
:func:`allow`, and modules this process has already imported (see :mod:`.codec`); each field then
checks the kind it needs. Pickled bytes or files are refused with an error saying why: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from composable_atorch.core import codec, untrusted
from composable_atorch.core.compose import compose
from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import lookup
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError

_PICKLE_REFUSED = "JSON (a plan written by strategy.dump); pickle is refused because unpickling runs arbitrary code"


def _looks_pickled(data: bytes) -> bool:
    # protocol 2+ starts with PROTO (0x80); protocol 0/1 streams start with an opcode such as
    # '(' or ']' and end with STOP '.'
    return data[:1] == b"\x80" or (data.rstrip()[-1:] == b"." and data[:1] in (b"(", b"]", b"}", b"c"))


def allow(*objects: Any) -> None:
    """Let every plan loaded later in this process name ``objects`` (classes, module-level functions)."""
    codec.allow(*objects)


def _from_seed_list(items, *, env, strict, allow=()) -> Plan:
    transforms = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            name, config = item, None
        elif isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str):
            name, config = item
        else:
            raise ConfigError(f"strategy[{i}]", item, "a name or a (name, config) pair")
        transforms.append(
            lookup(name).from_seed(codec.decode(config, allow) if isinstance(config, list | dict) else config)
        )
    out = tuple(transforms)
    for t in transforms:  # ATorch's keys that belong to another step here (sequence_parallel's sp_size)
        out = t.adjust_seed_list(out)
    return compose(*out, env=env, strict=strict)


def _from_text(text: str, *, env, strict, allow=()) -> Plan:
    try:
        data = untrusted.loads(text, "strategy JSON")
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "strategy JSON", text[:60], f"valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    if isinstance(data, dict):
        return Plan.from_dict(data, env=env, strict=strict, allow=allow)
    if isinstance(data, list):
        return _from_seed_list(data, env=env, strict=strict, allow=allow)
    raise ConfigError("strategy JSON", type(data).__name__, "a saved plan object or a list of strategy entries")


def load(strategy: Any, *, env: Environment | None = None, strict: bool | None = None, allow=()) -> Plan:
    """A Plan from any strategy form (see the module docstring); typed errors before any work.

    ``allow``: classes and module-level functions the plan may name beyond what this process has
    imported (e.g. ``allow=[MyBlock, my_batch_fn]``)."""
    codec.allow_table(allow)  # a bad allow-list fails even for a plan that names nothing
    if isinstance(strategy, Plan):
        return strategy
    if isinstance(strategy, bytes | bytearray):
        if _looks_pickled(bytes(strategy)):
            raise ConfigError("strategy bytes", "pickled data", _PICKLE_REFUSED)
        try:
            strategy = bytes(strategy).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError("strategy bytes", "binary data", "UTF-8 JSON text") from None
        return _from_text(strategy, env=env, strict=bool(strict), allow=allow)
    if isinstance(strategy, os.PathLike) or (isinstance(strategy, str) and strategy.strip()[:1] not in ("{", "[")):
        path = Path(strategy)
        if not path.is_file():
            raise ConfigError("strategy path", str(strategy), "an existing .json file, a JSON string, a list or a Plan")
        if path.suffix in (".pkl", ".pickle"):
            raise ConfigError("strategy file", str(path), _PICKLE_REFUSED)
        raw = untrusted.read_regular_file(path, "strategy file")
        if _looks_pickled(raw):
            raise ConfigError("strategy file", str(path), _PICKLE_REFUSED)
        return load(raw, env=env, strict=strict, allow=allow)
    if isinstance(strategy, str):
        return _from_text(strategy, env=env, strict=bool(strict), allow=allow)
    if isinstance(strategy, list | tuple):
        return _from_seed_list(strategy, env=env, strict=bool(strict), allow=allow)
    raise ConfigError(
        "strategy", type(strategy).__name__, "a Plan, a list of (name, config), a JSON string or bytes, or a .json path"
    )


def dump(plan: Any, path: str | os.PathLike | None = None) -> str:
    """Write the plan (or anything :func:`load` accepts) as JSON to ``path``; return the JSON text."""
    text = load(plan).to_json()
    if path is not None:
        target = Path(path)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, target)  # atomic: a crash leaves the old file or the new one, never half
    return text

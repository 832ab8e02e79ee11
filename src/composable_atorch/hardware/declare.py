"""A user's own device, declared as data: a dict, or a JSON / TOML file read as untrusted input.

    {"name": "my-h100", "base": "h100-sxm",
     "network": {"bandwidth": 25e9, "source": "our cluster: 200 Gb/s per GPU"}}

``base`` starts from a catalog device and overrides what the declaration gives (mappings key by key,
links field by field); without it every field must be there. A file is read like a plan file: a
regular file under the size bound, nesting under the depth bound, nothing imported and nothing
called (values are numbers, strings and lists; a string where a figure belongs is refused, whatever
it names). Every refusal is a :class:`~.spec.HardwareError` naming the field and what is allowed,
with the nearest field names for a misspelt one.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from composable_atorch import untrusted
from composable_atorch.errors import UntrustedInputError
from composable_atorch.hardware.catalog import get
from composable_atorch.hardware.spec import Efficiency, Hardware, HardwareError, Link
from composable_atorch.units import parse_bytes

FIELDS = tuple(f.name for f in fields(Hardware))
LINK_FIELDS = tuple(f.name for f in fields(Link))
CURVE_FIELDS = ("points", "source")
SUFFIXES = (".json", ".toml")


def _check_keys(data: Mapping, allowed: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=2)
            hint = f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""
            raise HardwareError(f"{where} field", key, f"one of {', '.join(allowed)}{hint}")


def _mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise HardwareError(where, type(value).__name__, "a table / object of named values")
    return value


def _curve(value: Any, where: str, origin: str) -> Efficiency:
    if isinstance(value, Efficiency):
        return value
    data = _mapping(value, where)
    _check_keys(data, CURVE_FIELDS, where)
    if "points" not in data:
        raise HardwareError(where, sorted(data), "a 'points' list of [size, fraction] pairs")
    points = data["points"]
    if not isinstance(points, list | tuple):
        raise HardwareError(f"{where}.points", type(points).__name__, "a list of [size, fraction] pairs")
    return Efficiency(tuple(tuple(p) if isinstance(p, list | tuple) else p for p in points), data.get("source", origin))


def _curves(value: Any, where: str, origin: str, base: Mapping | None = None) -> dict:
    data = _mapping(value, where)
    out = dict(base or {})
    out.update({k: _curve(v, f"{where}.{k}", origin) for k, v in data.items()})
    return out


def _link(value: Any, where: str, origin: str, base: Link | None) -> Link:
    if isinstance(value, Link):
        return value
    data = _mapping(value, where)
    _check_keys(data, LINK_FIELDS, where)
    merged = {} if base is None else {f: getattr(base, f) for f in LINK_FIELDS}
    for key, v in data.items():
        merged[key] = (
            _curves(v, f"{where}.collectives", origin, merged.get("collectives")) if key == "collectives" else v
        )
    if "bandwidth" in data and "source" not in data:
        merged["source"] = origin
    missing = [f for f in LINK_FIELDS if f not in merged]
    if missing:
        raise HardwareError(
            where, sorted(data), f"every one of {', '.join(LINK_FIELDS)} (missing {', '.join(missing)})"
        )
    return Link(**merged)


def from_dict(data: Any, origin: str = "declared") -> Hardware:
    """A Hardware from a declaration's values (see the module doc); ``origin`` is the default source."""
    data = _mapping(data, "hardware declaration")
    untrusted.check_depth(data, "hardware declaration")
    _check_keys(data, (*FIELDS, "base"), "hardware declaration")
    base = None
    if "base" in data:
        base = data["base"] if isinstance(data["base"], Hardware) else get(data["base"])
    values: dict[str, Any] = {} if base is None else {f: getattr(base, f) for f in FIELDS}
    sources = dict(values.get("sources") or {})
    for key, v in data.items():
        if key == "base":
            continue
        if key in ("intra", "network"):
            values[key] = _link(v, key, origin, values.get(key))
        elif key in ("gemm", "attention"):
            values[key] = _curves(v, key, origin, values.get(key))
        elif key == "memory":
            values[key] = _curve(v, key, origin)
        elif key == "peak_flops":
            values[key] = {**dict(values.get(key) or {}), **_mapping(v, key)}
            sources.update({f"peak_flops.{d}": origin for d in v})
        elif key == "memory_bytes":
            values[key] = parse_bytes(v, "memory_bytes", required=True) if isinstance(v, str) else v
        elif key == "sources":
            sources.update(_mapping(v, key))
        else:
            values[key] = v
        if key in ("memory_bytes", "memory_bandwidth", "launch_s"):
            sources[key] = origin
    values["sources"] = sources
    required = [f.name for f in fields(Hardware) if f.default is MISSING and f.default_factory is MISSING]
    missing = [m for m in required if m not in values]
    if missing:
        raise HardwareError(
            "hardware declaration",
            sorted(data),
            f"every one of {', '.join(missing)} (missing), or 'base' naming a catalog device to start from",
        )
    try:
        return Hardware(**values)
    except TypeError as exc:  # a value of a kind no field takes
        raise HardwareError("hardware declaration", str(exc), "the fields of Hardware with their types") from None


def load(path: str | os.PathLike) -> Hardware:
    """A declaration file (``.json`` or ``.toml``) read as untrusted data."""
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise HardwareError("hardware file", path, "a .json or .toml declaration")
    raw = untrusted.read_regular_file(path, "hardware file").decode("utf-8", errors="replace")
    try:
        if suffix == ".json":
            data = untrusted.loads(raw, "hardware file")
        else:
            import tomllib

            data = tomllib.loads(raw)
    except (json.JSONDecodeError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise HardwareError("hardware file", path, f"valid {suffix[1:].upper()} ({exc})") from None
    except RecursionError:
        raise UntrustedInputError("hardware file", path, f"nesting of at most {untrusted.MAX_DEPTH} levels") from None
    return from_dict(data, origin=f"declared in {os.path.basename(path)}")


def resolve(value: Any) -> Hardware:
    """A Hardware from a Hardware, a catalog name, a declaration file path or a declaration dict."""
    if isinstance(value, Hardware):
        return value
    if isinstance(value, Mapping):
        return from_dict(value)
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value.lower().endswith(SUFFIXES)):
        return load(value)
    return get(value)

"""Config values <-> JSON values. Never pickle, never import: classes travel as names.

Encoded forms: JSON scalars as they are; lists for tuples and lists (decoded as tuples, since
configs are frozen); objects for dicts; ``{"$dtype": "bfloat16"}`` for torch dtypes;
``{"$class": "package.module:Qual.Name"}`` for classes and ``{"$function": "package.module:name"}``
for module-level functions.

A plan is data, so a name in it never causes an import. A ``$class`` / ``$function`` resolves
only against an allow-list:

* objects the user passes (``strategy.load(..., allow=[MyBlock, my_batch_fn])``) or registers for
  the process (:func:`allow`);
* otherwise objects whose defining module this process has *already imported* (looked up in
  ``sys.modules``: the user's model module, torch, transformers, this library), found by their own
  module and qualified name (a name re-exported elsewhere does not count, so ``mymodel:Popen``
  cannot smuggle ``subprocess.Popen``), and never from Python's standard library, which holds
  process launchers and file openers no plan needs.

Each field then checks the kind it expects (a block class is an ``nn.Module`` subclass, a batch
function is a function, not a class): the resolver only decides what may be named at all.

The allow-list is for text from elsewhere (a file, another process's JSON). Where the library
serialises a plan it holds and reads it back (rank 0's decision broadcast to the other ranks, a
plan sent to a trial's processes) the objects the user handed over in code are passed as ``allow``
(:func:`named_objects` of the plan, the classes of the user's model): trusted in whatever module
they live (``__main__``, a spawned child's ``__mp_main__``, a notebook). A script's own module is
written ``__main__`` whichever name it runs under, so the same plan text means the same class in a
torchrun rank (``__main__``) and in a ``torch.multiprocessing.spawn`` child (``__mp_main__``).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any

import torch

from composable_atorch.core.untrusted import MAX_DEPTH
from composable_atorch.errors import ConfigError, UntrustedInputError

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
_PATH = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
)
_STDLIB = frozenset(sys.stdlib_module_names) | {"builtins", "__future__"}
_REGISTERED: dict[str, Any] = {}
_FIX = (
    "import the module that defines it before loading the plan, or pass it explicitly "
    "(strategy.load(..., allow=[obj]) / Plan.from_json(..., allow=[obj]) / composable_atorch.strategy.allow(obj))"
)


def _named(obj: Any) -> bool:
    return isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj)


def _module_name(name: str) -> str:
    """A script's module under the name a plan writes: multiprocessing's spawn runs the parent's
    ``__main__`` as ``__mp_main__`` in the child, the same script."""
    return "__main__" if name == "__mp_main__" else name


def class_path(obj: Any) -> str:
    """``module:QualName`` of a module-level class or function (what a plan stores)."""
    qual = getattr(obj, "__qualname__", "")
    if "<locals>" in qual or "<lambda>" in qual or not getattr(obj, "__module__", None):
        raise ConfigError(
            "class", obj, "a module-level class or function (named by its path) or its name as a string, saved as JSON"
        )
    return f"{_module_name(obj.__module__)}:{qual}"


def named_objects(value: Any) -> tuple[Any, ...]:
    """The classes and functions a config value holds (what its JSON names by path), each once."""
    found: dict[int, Any] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif _named(item) and not isinstance(item, torch.dtype):
            found.setdefault(id(item), item)
    return tuple(found.values())


def allow(*objects: Any) -> None:
    """Let plans loaded later in this process name ``objects`` (classes or module-level functions),
    even from modules the process has not imported or from the standard library."""
    for obj in objects:
        if not _named(obj):
            raise ConfigError("allow", obj, "classes or module-level functions")
        _REGISTERED[class_path(obj)] = obj


def allow_table(extra: Iterable[Any]) -> dict[str, Any]:
    table = dict(_REGISTERED)
    for obj in extra or ():
        if not _named(obj):
            raise ConfigError("allow", obj, "classes or module-level functions")
        with contextlib.suppress(ConfigError):  # a local class cannot be named by a plan: nothing to allow
            table[class_path(obj)] = obj
    return table


def resolve(path: Any, kind: str = "$class", allowed: dict[str, Any] | None = None) -> Any:
    """The object a ``$class`` / ``$function`` names, from the allow-list only; never imports."""
    if not isinstance(path, str) or len(path) > 300 or not _PATH.fullmatch(path):
        raise UntrustedInputError(f"{kind} path", path, "'package.module:QualName' (identifiers only)")
    table = _REGISTERED if allowed is None else allowed
    module_name, _, qual = path.partition(":")
    given = f"{_module_name(module_name)}:{qual}"  # a plan written by an older version in a spawned child
    if given in table:
        obj = table[given]
    else:
        if module_name.partition(".")[0] in _STDLIB:
            raise UntrustedInputError(
                f"{kind} path",
                path,
                f"a name outside Python's standard library, which a plan never names implicitly; {_FIX}",
            )
        module = sys.modules.get(module_name)
        if module is None and module_name == "__main__":  # a spawned child holds the script as __mp_main__
            module = sys.modules.get("__mp_main__")
        if module is None:
            raise UntrustedInputError(
                f"{kind} path", path, f"a name from a module this process has imported (plans never import); {_FIX}"
            )
        obj: Any = module
        for part in qual.split("."):  # plain attribute tables: no module __getattr__, no lazy import
            obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
            if obj is None:
                raise UntrustedInputError(f"{kind} path", path, f"a name defined in {module_name}; {_FIX}")
        own = _module_name(getattr(obj, "__module__", None) or "")
        if not _named(obj) or f"{own}:{getattr(obj, '__qualname__', None)}" != path:
            raise UntrustedInputError(
                f"{kind} path", path, f"a class or function named by its own module and name; {_FIX}"
            )
    if kind == "$class" and not isinstance(obj, type):
        raise UntrustedInputError("$class path", path, "a path naming a class (use $function for a function)")
    if kind == "$function" and isinstance(obj, type):
        raise UntrustedInputError("$function path", path, "a path naming a function, not a class")
    return obj


def resolve_class(path: str, allow: Iterable[Any] = ()) -> type:
    return resolve(path, "$class", allow_table(allow))


def encode(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        return {"$class": class_path(value)}
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return {"$function": class_path(value)}
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError("config key", bad[0], "string keys only, to be saved as JSON")
        return {k: encode(v) for k, v in value.items()}
    raise ConfigError("config value", value, "JSON scalars, tuples, dicts, torch dtypes, classes or functions")


def decode(value: Any, allow: Iterable[Any] = ()) -> Any:
    """The config value a JSON value encodes; names resolve against ``allow`` and the allow-list."""
    return _decode(value, allow_table(allow), 1)


def _decode(value: Any, allowed: dict[str, Any], depth: int) -> Any:
    if depth > MAX_DEPTH and isinstance(value, list | dict):
        raise UntrustedInputError("config", f"nested deeper than {MAX_DEPTH} levels", f"at most {MAX_DEPTH} levels")
    if isinstance(value, list):
        return tuple(_decode(v, allowed, depth + 1) for v in value)
    if isinstance(value, dict):
        if "$dtype" in value:
            if not isinstance(value["$dtype"], str) or value["$dtype"] not in _DTYPES:
                raise ConfigError("$dtype", value["$dtype"], ", ".join(_DTYPES))
            return _DTYPES[value["$dtype"]]
        for kind in ("$class", "$function"):
            if kind in value:
                return resolve(value[kind], kind, allowed)
        return {k: _decode(v, allowed, depth + 1) for k, v in value.items()}
    return value

"""The registry of transform classes: names and aliases to classes, and transforms built by name.

Registering a name that is taken is a ConfigError unless the class asks for it
(``class MyAmp(Transform, replace=True)``); tests scope their registrations with
:func:`registry_scope`. It sits below the Transform base class, the passes and the plan (which all
look transforms up by name), so none of them has to import the others to do so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from composable_atorch.errors import ConfigError, UnknownTransformError

_REGISTRY: dict[str, type] = {}
_ALIASES: dict[str, str] = {}
#: ATorch names whose transforms are not built (yet): name -> why.
_PLANNED: dict[str, str] = {}


def _same_class(a: type, b: type) -> bool:
    """The same class defined again (a module reloaded), not a different one under a taken name."""
    return a.__module__ == b.__module__ and a.__qualname__ == b.__qualname__


def register(cls: type, replace: bool = False) -> None:
    """Add a transform class under its name and aliases (Transform subclasses call this when defined)."""
    taken = _REGISTRY.get(cls.name)
    if taken is not None and not replace and not _same_class(taken, cls):
        raise ConfigError(
            f"transform name of {cls.__module__}.{cls.__qualname__}",
            cls.name,
            f"a name not taken (it is {taken.__module__}.{taken.__qualname__}); "
            f"to replace it on purpose: class {cls.__name__}(..., replace=True)",
        )
    for alias in cls.aliases:
        owner = _ALIASES.get(alias) or (alias if alias in _REGISTRY else None)
        if owner is not None and owner != cls.name and not replace:
            raise ConfigError(
                f"alias of transform {cls.name!r}", alias, f"an alias not taken (it names {owner!r}), or replace=True"
            )
    _REGISTRY[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name


@contextlib.contextmanager
def registry_scope() -> Iterator[None]:
    """Registrations made inside are undone on exit (and any replaced built-in restored).

    ``with registry_scope(): class Toy(Transform): name = "toy" ...`` — for tests and experiments.
    """
    saved = (dict(_REGISTRY), dict(_ALIASES), dict(_PLANNED))
    try:
        yield
    finally:
        for table, old in zip((_REGISTRY, _ALIASES, _PLANNED), saved, strict=True):
            table.clear()
            table.update(old)


def registry() -> dict[str, type]:
    """Registered transforms by canonical name (importing the package registers all built ones)."""
    return dict(_REGISTRY)


def register_planned(name: str, why: str) -> None:
    """Record an ATorch name whose transform is not built yet, so lookups say so instead of 'unknown'."""
    _PLANNED[name] = why


def lookup(name: str) -> type:
    """The transform class for a canonical name or alias; UnknownTransformError otherwise."""
    canonical = _ALIASES.get(name, name)
    if canonical in _REGISTRY:
        return _REGISTRY[canonical]
    known = set(_REGISTRY) | set(_ALIASES)
    if name in _PLANNED and name not in known:
        raise UnknownTransformError(name, known, note=f"not built yet ({_PLANNED[name]})")
    raise UnknownTransformError(name, known)


def build(name: str, config: dict[str, Any] | None = None) -> Any:
    """A transform from its registry name (or alias) and a config dict; ConfigError on bad fields."""
    cls = lookup(name)
    config = dict(config or {})
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ConfigError(f"{cls.name} config field {unknown[0]!r}", config[unknown[0]], f"one of {sorted(fields)}")
    return cls(**config)


def axis_owners(*, split: bool | None = None, batch: bool | None = None) -> dict[str, str]:
    """Registered transform name -> the mesh dimension its contract owns (``Contract.axis``), read from
    the declared axes; ``split`` / ``batch`` keep only the owners of sequence-split / batch axes (or
    only the others, with False). The search and the plan's readers take this map instead of keeping
    their own list of which step owns which dimension."""
    out = {}
    for name, cls in sorted(_REGISTRY.items()):
        axis = cls.contract.axis
        if axis is None or (split is not None and axis.split != split) or (batch is not None and axis.batch != batch):
            continue
        out[name] = axis.name
    return out

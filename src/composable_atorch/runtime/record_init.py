"""``record_module_init()``: build a model on the meta device and remember how each module was made.

    with record_module_init():
        meta_model = LlamaForCausalLM(LlamaConfig(...))     # nothing allocated
    layer = build_recorded(meta_model.model.layers[3])      # a real layer, built from its recorded args

Why: DeepSpeed's pipeline builds each stage from ``LayerSpec(cls, *args, **kwargs)``, so only the
layers of a rank's own stage are ever allocated. A model written with plain torch has no specs; this
context manager records them while the user's own constructor runs: every ``nn.Module`` subclass's
``__init__`` is wrapped to keep ``_init_args`` / ``_init_kwargs`` (after the original init, so a
subclass's arguments win over its parent's ``super().__init__`` call) and to move the module to
``meta`` (``torch.device("meta")`` does not catch every ``nn.Parameter(...)``).

Weights are not recorded: a built module is initialised again (its constructor's
``reset_parameters``, then Hugging Face's ``_init_weights`` of the root model when there is one).

Every class patched is restored on exit, also when the body raises. Unlike ATorch's version this
keeps the exact original ``__init__`` of each class that defines one (classes that inherit
``__init__`` are not touched), so a class defined inside the body is restored to its own
``__init__`` too, not to its parent's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from composable_atorch.errors import ConfigError

INIT_ARGS, INIT_KWARGS = "_init_args", "_init_kwargs"
_WRAPPED = "_composable_atorch_recording"


def _wrap(init):
    @functools.wraps(init)
    def wrapper(module, *args, **kwargs):
        init(module, *args, **kwargs)
        module.__dict__[INIT_ARGS] = args
        module.__dict__[INIT_KWARGS] = kwargs
        module.to("meta")

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    stack = list(cls.__subclasses__())
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        yield c
        stack.extend(c.__subclasses__())


@contextlib.contextmanager
def record_module_init() -> Iterator[None]:
    """Meta-initialise modules built inside, recording each one's init args (see the module doc)."""
    patched: list[tuple[type, Any]] = []

    def patch(cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if callable(init) and not getattr(init, _WRAPPED, False):
            patched.append((cls, init))
            cls.__init__ = _wrap(init)

    had_own_hook = "__init_subclass__" in nn.Module.__dict__
    old_hook = nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):
        if had_own_hook:
            old_hook.__get__(None, cls)(**kwargs)
        else:
            super(nn.Module, cls).__init_subclass__(**kwargs)
        patch(cls)

    meta = torch.device("meta")
    entered = False
    try:
        for cls in list(_subclasses(nn.Module)):
            patch(cls)
        nn.Module.__init_subclass__ = classmethod(init_subclass)
        meta.__enter__()
        entered = True
        yield
    finally:
        if entered:
            meta.__exit__(None, None, None)
        if had_own_hook:
            nn.Module.__init_subclass__ = old_hook
        elif "__init_subclass__" in nn.Module.__dict__:
            del nn.Module.__init_subclass__
        for cls, init in reversed(patched):
            cls.__init__ = init


def is_recorded(module: nn.Module) -> bool:
    return INIT_ARGS in module.__dict__


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def build_recorded(meta_module: nn.Module, init_weights=None) -> nn.Module:
    """A real module rebuilt from ``meta_module``'s recorded args, then ``init_weights`` applied to
    each submodule (Hugging Face's ``_init_weights`` of the root model; the constructor's own
    ``reset_parameters`` otherwise). A module that is real already is deep-copied (weights kept).
    """
    if not is_meta(meta_module):
        return copy.deepcopy(meta_module)
    if not is_recorded(meta_module):
        raise ConfigError(
            f"meta module {type(meta_module).__name__}",
            "built on the meta device without recorded init args",
            "build the model inside `with record_module_init():` (or pass a real model)",
        )
    cls = type(meta_module)
    module = cls(*meta_module.__dict__[INIT_ARGS], **meta_module.__dict__[INIT_KWARGS])
    if init_weights is not None:
        with torch.no_grad():
            module.apply(init_weights)
    return module


def hf_init_weights(root: nn.Module):
    """The Hugging Face root model's ``_init_weights`` (None for a model that has none)."""
    fn = getattr(root, "_init_weights", None)
    return fn if callable(fn) else None

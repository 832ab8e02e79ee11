"""Memory: activation checkpointing of chosen blocks, keeping parameter names.

torch's ``checkpoint_wrapper`` renames parameters (``._checkpoint_wrapped_module.``), which would
break optimizer rebinding and saved state dicts; the composable
``torch.distributed._composable.checkpoint`` works in place and keeps names, so it is the default.
The reentrant variant (for models with ``@torch.jit.script`` parts, as ATorch notes) wraps the
block's forward in place, which also keeps names; keyword arguments (every Hugging Face decoder
layer takes ``attention_mask=...``, ``position_embeddings=...``) are passed to torch's reentrant
checkpoint positionally and rebuilt inside, as torch's ``checkpoint_wrapper`` packs them.

ATorch's checkpoint config keys: ``wrap_class``, ``no_reentrant`` (default non-reentrant, as ATorch
documents), ``max_checkpoint_module_num`` (only the first N matching modules),
``selective_offload`` (validated as ATorch does, no effect on a CPU: it moves saved activations
from GPU memory to host memory, where they already are) and ``use_te_impl`` (no effect here:
transformer-engine's checkpoint needs a CUDA GPU and its package).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch.utils.checkpoint as torch_checkpoint
from torch.distributed._composable import checkpoint as composable_checkpoint

from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.transforms._util import is_block_target, outermost_matches


def _target_name(t) -> str:
    return t.__name__ if isinstance(t, type) else t


def _reentrant_forward(inner):
    """``inner`` run under torch's reentrant checkpoint, keyword arguments included.

    The reentrant checkpoint (an autograd.Function) takes positional arguments only: keyword
    values travel positionally after the positional ones and the keys in the closure, so tensors
    among them are tracked for the backward.
    """

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not kwargs:
            return torch_checkpoint.checkpoint(inner, *args, use_reentrant=True)
        keys, n = tuple(kwargs), len(args)

        def run(*flat):
            return inner(*flat[:n], **dict(zip(keys, flat[n:], strict=True)))

        return torch_checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=True)

    forward._composable_atorch_reentrant = True
    return forward


#: the arguments a Hugging Face block takes its key/value cache by (older names first)
CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")
#: transformers 5.24 renamed the block's cache argument to plain ``cache``: a name too common to
#: drop on sight, so it counts only in a block whose signature also has ``use_cache``
GENERIC_CACHE_ARG = "cache"


def no_cache_in_training(module) -> bool:
    """Run ``module`` without a key/value cache while training (a forward pre-hook placed before
    the checkpoint's own, so the recompute sees the same arguments); returns whether it applies.

    Why: a Hugging Face model built with ``use_cache=True`` (Llama-2's and GPT-2's configs) hands
    each decoder layer its ``DynamicCache``; the layer appends its keys and values, and the
    backward's recompute of a checkpointed layer appends them *again*, so the cache holds every
    layer's keys and values twice over through the backward (measured on the Llama-2-7B config
    at 4 x 4096 tokens: about 16 GiB per rank). The gradients are unchanged (causal attention
    reads the first copy), only memory is lost. Hugging Face's own gradient checkpointing drops
    the cache in training for the same reason; in eval mode the cache is left alone."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    params = signature.parameters
    names = tuple(n for n in (*CACHE_ARGS, "use_cache") if n in params)
    if GENERIC_CACHE_ARG in params and "use_cache" in params:
        names = (GENERIC_CACHE_ARG, *names)
    if not names:  # not a cache-carrying block
        return False

    def drop_cache(mod, args, kwargs):
        if not mod.training:
            return None
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return None
        changed = False
        for name in names:
            value = bound.arguments.get(name)
            if name == "use_cache" and value:
                bound.arguments[name], changed = False, True
            elif name != "use_cache" and value is not None:
                bound.arguments[name], changed = None, True
        return (bound.args, bound.kwargs) if changed else None

    module.register_forward_pre_hook(drop_cache, with_kwargs=True, prepend=True)
    return True


@dataclass(frozen=True)
class Checkpoint(Transform):
    """Recompute the activations of each matching block in the backward pass instead of storing them."""

    name = "checkpoint"
    contract = Contract(stage=Stage.CHECKPOINT, roles=("activation_checkpoint",))

    targets: tuple = ()
    reentrant: bool = False
    #: ATorch's ``max_checkpoint_module_num``: checkpoint only the first N matching modules (None: all).
    max_modules: int | None = None
    #: ATorch keys accepted with no effect on this machine kind (named in explain()).
    inert: tuple[str, ...] = ()

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, type | str):
            targets = (targets,)
        targets = tuple(targets)
        if not targets:
            raise ConfigError("checkpoint targets", targets, "at least one block class, class name or module name")
        bad = [t for t in targets if not is_block_target(t)]
        if bad:
            raise ConfigError(
                "checkpoint target", bad[0], "an nn.Module subclass, a class name or a module's qualified name"
            )
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "reentrant", bool(self.reentrant))
        if self.max_modules is not None and (
            isinstance(self.max_modules, bool) or not isinstance(self.max_modules, int) or self.max_modules < 0
        ):
            raise ConfigError(
                "checkpoint.max_modules (max_checkpoint_module_num)",
                self.max_modules,
                "None (every matching module) or an integer >= 0",
            )
        inert = tuple(sorted(set(self.inert)))
        bad = [k for k in inert if k not in INERT_KEYS]
        if bad:
            raise ConfigError("checkpoint.inert", bad[0], f"one of {sorted(INERT_KEYS)}")
        object.__setattr__(self, "inert", inert)

    @classmethod
    def candidates(cls, search):
        return tuple(cls(targets=(b,)) for b in search.block_classes)

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's config: a tuple of classes/names, or ``{"wrap_class": ..., "no_reentrant": ...}``."""
        if config is None:
            raise ConfigError("checkpoint config", None, "the block classes or names to checkpoint, e.g. (Block,)")
        return checkpoint(config)

    def describe(self):
        kind = "reentrant" if self.reentrant else "non-reentrant"
        limit = "" if self.max_modules is None else f"; first {self.max_modules} only"
        inert = "".join(f"; {k}: {INERT_KEYS[k]}" for k in self.inert)
        return f"checkpoint({', '.join(_target_name(t) for t in self.targets)}; {kind}{limit}{inert})"

    def sort_key(self):
        key = (tuple(_target_name(t) for t in self.targets), self.reentrant, self.max_modules, self.inert)
        return (int(self.contract.stage), self.name, repr(key))

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        found = outermost_matches(state.model, self.targets)
        if not found:
            raise ConfigError(
                "checkpoint targets",
                tuple(_target_name(t) for t in self.targets),
                f"classes or names of modules in {type(state.model).__name__} (none matched)",
            )
        matched = len(found)
        if self.max_modules is not None:
            found = found[: self.max_modules]
        uncached = 0
        for _, module in found:
            uncached += no_cache_in_training(module)
            if self.reentrant:
                if not getattr(module.forward, "_composable_atorch_reentrant", False):  # applied once per module
                    module.forward = _reentrant_forward(module.forward)
            else:
                composable_checkpoint(module)
        if self.max_modules is not None:
            state.note(
                self.name,
                f"max_checkpoint_module_num={self.max_modules}: {len(found)} of {matched} matching modules "
                "checkpointed",
            )
        for key in self.inert:
            state.note(self.name, f"{key}: {INERT_KEYS[key]}")
        if not found:
            return state
        if uncached:
            state.note(
                self.name,
                f"{uncached} checkpointed block(s) take a key/value cache: dropped in training, as Hugging Face's "
                "own gradient checkpointing does (the recompute would append every block's keys and values again)",
            )
        names = sorted({type(m).__name__ for _, m in found})
        state.note(
            self.name,
            f"{len(found)} module(s) checkpointed ({', '.join(names)}): "
            f"{', '.join(q or '<root>' for q, _ in found[:6])}{' ...' if len(found) > 6 else ''}",
        )
        return state


#: ATorch checkpoint keys accepted with no effect here, and why (shown in explain()).
INERT_KEYS = {
    "use_te_impl": "no effect: transformer-engine's checkpoint needs a CUDA GPU and the transformer-engine package; "
    "torch's is used",
    "selective_offload": "no effect on a CPU: it offloads saved activations from GPU memory to host memory, where they "
    "already are",
}
SEED_KEYS = ("wrap_class", "no_reentrant", "max_checkpoint_module_num", "selective_offload", "use_te_impl")


def _from_seed_dict(cfg: dict) -> Checkpoint:
    """ATorch's dict config, each key with ATorch's meaning (checkpoint_optimization.py)."""
    unknown = sorted(set(cfg) - set(SEED_KEYS))
    if unknown:
        raise ConfigError(
            f"checkpoint config key {unknown[0]!r}", cfg[unknown[0]], ", ".join(repr(k) for k in SEED_KEYS)
        )
    if "wrap_class" not in cfg:
        raise ConfigError(
            "checkpoint config key 'wrap_class'",
            None,
            "the block classes or names to checkpoint, e.g. {'wrap_class': (Block,)}",
        )
    wrap = cfg["wrap_class"]
    inert = []
    offload = cfg.get("selective_offload")
    no_reentrant = cfg.get("no_reentrant")
    if offload is not None:
        if (
            no_reentrant is not None and not no_reentrant
        ):  # ATorch raises too: selective offloading needs the non-reentrant checkpoint
            raise ConfigError(
                "checkpoint config 'no_reentrant'",
                False,
                "True (or absent) with 'selective_offload': it needs the non-reentrant checkpoint",
            )
        if not isinstance(offload, dict) or "offload_args" not in offload or "num_layers" not in offload:
            raise ConfigError(
                "checkpoint config 'selective_offload'",
                offload,
                "a dict with 'offload_args' and 'num_layers' (as ATorch)",
            )
        inert.append("selective_offload")
    if cfg.get("use_te_impl"):
        inert.append("use_te_impl")
    limit = cfg.get("max_checkpoint_module_num")
    return Checkpoint(
        targets=wrap if isinstance(wrap, tuple | list) else (wrap,),
        reentrant=no_reentrant is not None and not no_reentrant,
        max_modules=limit,
        inert=tuple(inert),
    )


def checkpoint(*targets, reentrant: bool = False, max_modules: int | None = None) -> Checkpoint:
    """``checkpoint(Block)``, ``checkpoint("Block", "mlp")``, or ATorch's dict form.

    The dict form is ATorch's ``{"wrap_class": (Block,), "no_reentrant": False,
    "max_checkpoint_module_num": 4, "selective_offload": {...}, "use_te_impl": False}``.
    """
    if len(targets) == 1 and isinstance(targets[0], dict):
        return _from_seed_dict(dict(targets[0]))
    if len(targets) == 1 and isinstance(targets[0], tuple | list):
        targets = tuple(targets[0])
    return Checkpoint(targets=tuple(targets), reentrant=reentrant, max_modules=max_modules)

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

import inspect
import sys
import types
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed._composable import checkpoint as composable_checkpoint

from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.transforms._util import is_block_target, outermost_matches


def _target_name(t) -> str:
    return t.__name__ if isinstance(t, type) else t


#: the block's own forward (a bound method) under the reentrant wrapper
_INNER = "_composable_atorch_inner"


def _reentrant_forward(self, *args, **kwargs):
    """The block's forward run under torch's reentrant checkpoint, keyword arguments included.

    The reentrant checkpoint (an autograd.Function) takes positional arguments only: keyword
    values travel positionally after the positional ones and the keys in the closure, so tensors
    among them are tracked for the backward. A call the cache hook marks to run plainly (a
    pre-filled key/value cache, see ``cache_guard``) is not checkpointed.

    Bound to the block as a method (and the inner forward kept as a bound method on it), not a
    closure over the block: a ``copy.deepcopy`` of the model (ddp's probe replica) then runs the
    copy's own weights, not the original's (a closure left every copied block's parameters
    without a gradient, so the probe turned on ``find_unused_parameters``, which the reentrant
    checkpoint breaks: "Expected to mark a variable ready only once").
    """
    inner = getattr(self, _INNER)
    if getattr(self, _PLAIN_CALL, False) or not torch.is_grad_enabled():  # no backward: nothing to recompute
        return inner(*args, **kwargs)
    if not kwargs:
        return torch_checkpoint.checkpoint(inner, *args, use_reentrant=True)
    keys, n = tuple(kwargs), len(args)

    def run(*flat):
        return inner(*flat[:n], **dict(zip(keys, flat[n:], strict=True)))

    return torch_checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=True)


_reentrant_forward._composable_atorch_reentrant = True


def _wrap_reentrant(module) -> None:
    setattr(module, _INNER, module.forward)
    module.forward = types.MethodType(_reentrant_forward, module)


#: the names a Hugging Face block takes its key/value (or state-space) cache by: transformers 5.x's
#: ``cache`` and the older names; any argument holding a transformers ``Cache`` counts whatever its name
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")
#: set on a block for one call that must run without checkpointing (its cache already holds tokens)
_PLAIN_CALL = "_composable_atorch_plain_call"


def _is_hf_cache(value) -> bool:
    tf = sys.modules.get("transformers.cache_utils")
    return tf is not None and isinstance(value, tf.Cache)


def _layer_indices(module) -> tuple[int, ...]:
    """The cache slots ``module`` writes: the ``layer_idx`` of its attention (HF's convention), if any."""
    found = {getattr(m, "layer_idx", None) for m in module.modules()}
    return tuple(sorted(i for i in found if isinstance(i, int) and not isinstance(i, bool)))


def _layer_holds_state(layer) -> bool:
    previous = getattr(layer, "has_previous_state", None)  # linear-attention / state-space layers
    if isinstance(previous, dict) and any(previous.values()):
        return True
    if not getattr(layer, "is_initialized", False):
        return False
    try:
        return layer.get_seq_length() > 0
    except (AttributeError, TypeError, ValueError):
        return True  # a layer kind that cannot say: count it as holding state


def _cache_holds_state(cache, indices: tuple[int, ...]) -> bool:
    """Whether the cache holds anything the block's forward would read (at its own slots if known)."""
    subs = [getattr(cache, n) for n in ("self_attention_cache", "cross_attention_cache") if hasattr(cache, n)]
    if subs:  # an encoder-decoder cache: self- and cross-attention caches
        return any(_cache_holds_state(c, indices) for c in subs)
    layers = list(getattr(cache, "layers", ()))
    picked = [layers[i] for i in indices if i < len(layers)] if indices else layers
    return any(_layer_holds_state(layer) for layer in picked)


def _holds_state(value, indices) -> bool:
    if _is_hf_cache(value):
        return _cache_holds_state(value, indices)
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, tuple | list):
        return any(_holds_state(v, indices) for v in value)
    return value is not None


def takes_cache(module) -> bool:
    """Whether ``module.forward`` has a key/value cache argument (by name or a ``Cache`` annotation)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(n in CACHE_ARGS or "Cache" in str(p.annotation) for n, p in params.items())


def cache_guard(module) -> None:
    """Make a checkpointed block recompute exactly what its forward saw when a cache is passed.

    Hooks placed around the checkpoint's own (the pre-hook before it, the post-hook after), so
    the recompute sees the arguments as changed here. While training with gradients:

    - a cache that holds nothing for this block (what a Hugging Face model builds for itself
      when ``use_cache`` is left on, its default: a ``DynamicCache``, Gemma 2's sliding / full
      layers, T5's ``EncoderDecoderCache``, a state-space cache) carries nothing into the
      block, so it is dropped (and ``use_cache`` set off): the forward computes the same, and
      the recompute does not append the block's keys and values a second time (which doubled
      the keys against a mask built for one copy: a shape error, or twice the cache memory).
      Hugging Face's own gradient checkpointing drops it the same way;
    - a cache that already holds tokens (a prefix, prefix tuning) is read by the forward and
      dropping it would change the result, so that call runs without checkpointing: exact,
      the cache appended once, only that call's memory saving lost.

    In eval mode or under ``no_grad`` nothing is recomputed and the cache is left alone.
    """
    try:
        signature = inspect.signature(getattr(module, _INNER, module.forward))
    except (TypeError, ValueError):
        signature = None
    indices = _layer_indices(module)

    def find(args, kwargs):
        """(bound arguments, cache names -> values, the **kwargs name) or None."""
        if signature is None:
            return None
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return None
        var_kw = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        found = {}
        for name, value in bound.arguments.items():
            if name == var_kw:
                found.update({(var_kw, k): v for k, v in value.items() if _is_cache_arg(k, v)})
            elif _is_cache_arg(name, value):
                found[(None, name)] = value
        return bound, found, var_kw

    def pre(mod, args, kwargs):
        if not (mod.training and torch.is_grad_enabled()):
            return None
        got = find(args, kwargs)
        if got is None:
            return None
        bound, found, var_kw = got
        extra = dict(bound.arguments.get(var_kw) or {}) if var_kw else {}
        if not found and not bound.arguments.get("use_cache") and not extra.get("use_cache"):
            return None
        if any(_holds_state(v, indices) for v in found.values()):
            setattr(mod, _PLAIN_CALL, True)
            if not getattr(mod.forward, "_composable_atorch_reentrant", False):
                composable_checkpoint.state(mod).enable_hook = False
            return None
        for outer, name in found:
            if outer is None:
                bound.arguments[name] = None
            else:
                extra[name] = None
        if bound.arguments.get("use_cache"):
            bound.arguments["use_cache"] = False
        if extra.get("use_cache"):
            extra["use_cache"] = False
        if var_kw and extra:
            bound.arguments[var_kw] = extra
        return bound.args, bound.kwargs

    def post(mod, args, output):
        if getattr(mod, _PLAIN_CALL, False):
            setattr(mod, _PLAIN_CALL, False)
            if not getattr(mod.forward, "_composable_atorch_reentrant", False):
                composable_checkpoint.state(mod).enable_hook = True

    module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    module.register_forward_hook(post, always_call=True)


def _is_cache_arg(name, value) -> bool:
    return value is not None and (_is_hf_cache(value) or name in CACHE_ARGS)


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
            uncached += takes_cache(module)
            if self.reentrant:
                if getattr(module.forward, "_composable_atorch_reentrant", False):  # applied once per module
                    continue
                _wrap_reentrant(module)
            else:
                composable_checkpoint(module)
            cache_guard(module)
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
                f"{uncached} checkpointed block(s) take a key/value cache: dropped in training while empty (what a "
                "model with use_cache on builds for itself), as Hugging Face's own gradient checkpointing does (the "
                "recompute would append every block's keys and values again); a call whose cache already holds tokens "
                "(a prefix) runs without checkpointing, so the recompute never reads a cache the forward changed",
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

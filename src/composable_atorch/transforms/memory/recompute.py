"""How a checkpointed block runs: the hooks and wrappers that make torch's checkpoints recompute
exactly what the forward computed, and which op outputs selective checkpointing keeps.

- :func:`checkpoint_first`: torch's composable checkpoint (names kept), its pre-hook ahead of the
  hooks already on the block, so the recompute replays them from the block's own input;
- :func:`wrap_reentrant`: torch's reentrant checkpoint around the block's forward in place (names
  kept), keyword arguments passed positionally and rebuilt inside, as torch's
  ``checkpoint_wrapper`` packs them;
- :func:`cache_guard`: a Hugging Face key/value cache that holds nothing is dropped in training, a
  call whose cache holds tokens runs unchecked (see its docstring);
- :func:`selective_contexts`: selective (op-level) checkpointing, torch's
  ``create_selective_checkpoint_contexts`` with :func:`save_expensive_ops`. It keeps the outputs of
  the ops that are expensive to rerun and cheap to keep, and reruns the rest (norms, activations,
  element-wise ops, views), as torchtitan's ``op`` selective checkpointing does
  (torchtitan/distributed/activation_checkpoint.py):

  - matmuls (``mm``, ``addmm``, ``bmm``, ``_scaled_mm``; ``linear`` where a backend keeps it
    whole), every one of them (torchtitan reruns every second ``mm`` to save more memory; not
    done here);
  - attention: every scaled-dot-product kernel (flash, memory-efficient, cuDNN, the fused
    override, the CPU flash kernel) and flex attention;
  - collectives whose output a rerun would fetch again: reduce-scatter and all-to-all, when the
    block calls them as functional ops;
  - ``max`` (the absolute maximum an fp8 scale is computed from) and ``topk`` (a router's expert
    choice), so the rerun uses the same scale and the same experts.

  Every other op is ``PREFER_RECOMPUTE``; the saved ones are ``MUST_SAVE``, so torch.compile's
  partitioner keeps them too. The op set is resolved once by name: ops a build lacks are skipped.

  A saved output the block then changes in place (Mixtral's router divides its top-k weights with
  ``/=``, a user block writes ``out = self.fc2(h); out += x``) is kept as the op made it: torch's
  cache holds the very tensor the block mutates, and its rerun refused it ("Tensor cached during
  selective activation checkpoint has been mutated") in the backward, after all the forward's work.
  :class:`_KeepsMutatedOutputs` copies such an entry just before the forward's in-place op writes
  to it, so the rerun replays the op's own output and then the same in-place op, as the forward did.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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


def wrap_reentrant(module) -> None:
    """Checkpoint ``module``'s forward with torch's reentrant checkpoint, in place."""
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


def checkpoint_first(module, **kwargs) -> None:
    """torch's composable checkpoint, its pre-hook moved before the hooks already on ``module``.

    The recompute calls ``module(*args)`` again with every other hook on: the args it replays are
    the ones the checkpoint's pre-hook saw. Registered last (torch's way), that hook saw the args as
    earlier pre-hooks left them, and the recompute ran those hooks a second time on them: tensor
    parallel's sequence split of the first block cut its already-cut input again (a CheckpointError,
    or a shape error under selective checkpointing). Run first, it saves the block's own input and the
    recompute replays the hooks from it, as the forward did. Hooks added after (FSDP's unshard) stay
    inside the checkpointed region, as before.
    """
    hooks = module._forward_pre_hooks
    before = set(hooks)
    composable_checkpoint(module, **kwargs)
    for key in [k for k in hooks if k not in before]:
        hooks.move_to_end(key, last=False)


def _is_cache_arg(name, value) -> bool:
    return value is not None and (_is_hf_cache(value) or name in CACHE_ARGS)


#: what selective checkpointing saves, by kind (``namespace.op.overload`` under ``torch.ops``)
SAVED_OPS: dict[str, tuple[str, ...]] = {
    "matmul": (
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten._scaled_mm.default",
        "aten.linear.default",
    ),
    "attention": (
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default",
        "higher_order.flex_attention",
    ),
    "collective": (
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
    ),
    "fp8 scale / router choice": ("aten.max.default", "aten.topk.default"),
}


def _resolve(path: str):
    obj = torch.ops
    try:
        for part in path.split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


@functools.cache
def saved_ops() -> frozenset:
    """The op overloads whose outputs are kept (those this torch build registers)."""
    return frozenset(op for paths in SAVED_OPS.values() for op in map(_resolve, paths) if op is not None)


def save_expensive_ops(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The policy: keep the outputs of :data:`SAVED_OPS`, rerun everything else."""
    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


#: ops that carry no tensor and compute nothing, passed through both modes uncounted: fsdp's
#: forward-input cast (bf16 / fp16 parameters) runs in a hook under a ``record_function``, which
#: the forward runs before the checkpoint starts and the recompute inside it
PASSED_OPS = (
    "profiler._record_function_enter.default",
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit._RecordFunction",
)


@functools.cache
def passed_ops() -> frozenset:
    return frozenset(op for op in map(_resolve, PASSED_OPS) if op is not None)


class _PassProfilerOps:
    """Mixed into torch's two selective-checkpoint modes: :data:`PASSED_OPS` run as they are, so a
    profiler range opened on one side only does not read as a different forward."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in passed_ops():
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes to: its schema's mutable arguments (``out=`` included)."""
    schema = getattr(func, "_schema", None)  # higher-order ops have none and write nothing
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _storage(t: torch.Tensor):
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass without a storage
        return None


def _tracing() -> bool:
    """Under torch.compile's tracing the cache is a graph annotation and in-place ops are
    functionalized: nothing to copy (torch's own ``_is_compiling`` test)."""
    proxy = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    return torch.compiler.is_compiling() or proxy is not None


class _KeepsMutatedOutputs:
    """Mixed into torch's caching mode (the forward's): before an op writes in place to a tensor
    sharing storage with a cached output, that entry is replaced by a copy of its value then (the
    op's own output), so the recompute's cached mode hands back what the op made. Entries are
    torch's ``_VersionWrapper`` (``val``, ``version``); on a torch whose cache looks otherwise,
    nothing is copied and torch's own check stands."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        written = _written(func, args, kwargs or {})
        if written and not _tracing():
            hit = {key for key in map(_storage, written) if key is not None}
            if hit:
                _copy_entries(self.storage, hit)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _copy_entries(storage, hit: set) -> None:
    for entries in storage.values():
        for entry in entries.values() if isinstance(entries, dict) else entries:
            for wrapper in tree_leaves(entry):
                val = getattr(wrapper, "val", None)
                if isinstance(val, torch.Tensor) and hasattr(wrapper, "version") and _storage(val) in hit:
                    wrapper.val = val.clone()  # below this mode (a mode is off inside its own handler)
                    wrapper.version = wrapper.val._version


@functools.cache
def _passing(mode_class: type, keeps_mutated: bool = False) -> type:
    bases = (_PassProfilerOps, _KeepsMutatedOutputs, mode_class) if keeps_mutated else (_PassProfilerOps, mode_class)
    return type(f"ProfilerPassing{mode_class.__name__}", bases, {})


def selective_contexts():
    """A fresh pair of contexts per checkpointed call (torch's ``context_fn``): the forward's
    caching mode (which keeps what in-place ops would change, :class:`_KeepsMutatedOutputs`) and
    the recompute's cached mode, sharing the call's saved outputs, each letting
    :data:`PASSED_OPS` through."""
    caching, cached = create_selective_checkpoint_contexts(save_expensive_ops)
    caching.__class__ = _passing(type(caching), keeps_mutated=True)
    cached.__class__ = _passing(type(cached))
    return caching, cached


def describe_saved() -> str:
    """One line for explain(): what selective checkpointing keeps."""
    return (
        "selective: saves the outputs of matmuls (mm, addmm, bmm, _scaled_mm, linear), attention (every "
        "scaled_dot_product kernel, the CPU flash one included; flex_attention), reduce_scatter / all_to_all, "
        "max (fp8 scales) and topk (router choice); every other op is recomputed in the backward"
    )

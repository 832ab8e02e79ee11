"""Kernels a fake CPU step would run otherwise than the target device does, pointed at what it runs.

* transformers 5 mixtures of experts: their experts run ``torch.nn.functional.grouped_mm`` where torch
  has it; on the CPU its kernel takes fp32, but torch's fake (meta) registration of ``grouped_mm``
  accepts bf16 only, so an fp32 MoE model cannot be simulated as it runs. Transformers' own fallback
  (``transformers::grouped_mm_fallback``, registered with a fake implementation) computes the same
  products with the same output shapes, so while a step is simulated the dispatcher is pointed at it
  for fake tensors (:func:`fake_grouped_mm`). Its fake kernel runs no matmul and torch's flop
  counter has no formula for either: the traced step counts them from their shapes (:func:`grouped_flops`).
* a lower-right causal bias (``torch.nn.attention.bias``, context parallelism's chunks over the keys before
  them): on CUDA SDPA runs it as the flash kernel's causal mode, no mask held, only the visible blocks
  computed; on the CPU torch materializes the ``(q, k)`` mask and computes every score. For a CUDA
  target the simulated step computes it as two flash calls with the same FLOPs and no mask
  (:func:`flash_lower_right`): the keys every query sees, unmasked, and the square diagonal with
  ``is_causal``. Only its kernels' key lengths differ from the one CUDA call (their efficiency is read
  at those lengths). Numerically it is not the attention: fake tensors only.

Real tensors are untouched by those. And the other way round, for an estimate on this very CPU: a
traced kernel re-run on real tensors of its shapes, to time it (:func:`replay_seconds`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten


@contextlib.contextmanager
def fake_grouped_mm():
    """Within: transformers' grouped-mm check answers False for fake weights (the fallback runs)."""
    try:
        from transformers.integrations import moe
    except ImportError:  # no transformers (or no MoE support in it): nothing to route
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def can_use(input, weight, offs):
        if isinstance(weight, FakeTensor) or isinstance(input, FakeTensor):
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original

#: grouped GEMMs (a mixture of experts' experts, every expert's tokens in one call): torch's own and the
#: fallback transformers 5 registers as custom ops (:func:`fake_grouped_mm` routes fake tensors to it),
#: whose fake kernels run no matmul and which torch's flop counter has no formula for
GROUPED = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward"}


def grouped_flops(name: str, args) -> float:
    """FLOPs of a grouped GEMM from its shapes (the groups' sizes change none of them): tokens ``(S, K)``
    against stacked weights ``(E, K, N)``: ``2 S K N``; the fallback's backward computes the input's and
    the weights' gradients: twice that; torch's ``_grouped_mm`` also takes batched ``(E, M, K) x (E, K, N)``
    and ``(M, S) x (S, N)`` grouped along ``S`` (a weight gradient): ``2 M S N``."""
    a, b = args[0], args[1]
    if name == "grouped_mm_fallback_backward":
        return 4.0 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]


def _as_flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The two flash calls a lower-right bias's FLOPs are (module doc), or None for any other call."""
    from torch.nn.attention.bias import CausalBias, CausalVariant  # imports dynamo (0.9 s): only when used

    lower_right = isinstance(attn_mask, CausalBias) and attn_mask.variant == CausalVariant.LOWER_RIGHT
    if not (lower_right and isinstance(query, FakeTensor)) or is_causal:
        return None
    cut = attn_mask.seq_len_kv - attn_mask.seq_len_q
    if cut <= 0:  # square: torch itself calls SDPA with is_causal
        return None
    kw = {"dropout_p": dropout_p, "scale": scale, "enable_gqa": enable_gqa}
    seen = F.scaled_dot_product_attention(query, key[..., :cut, :], value[..., :cut, :], **kw)
    diagonal = F.scaled_dot_product_attention(query, key[..., cut:, :], value[..., cut:, :], is_causal=True, **kw)
    return seen + diagonal


@contextlib.contextmanager
def flash_lower_right(cuda: bool):
    """Within, for a CUDA target (``cuda``): a fake lower-right causal SDPA as the flash kernel's work.
    The bias's own dispatch is replaced, not a mode entered: a checkpoint's recompute in the backward
    must compute the same way (torch function modes do not reach it)."""
    if not cuda:
        yield
        return
    from torch.nn.attention.bias import CausalBias

    original = CausalBias.__dict__["_dispatch"]

    def dispatch(*args, **kwargs):
        out = _as_flash(*args, **kwargs)
        return original.__func__(*args, **kwargs) if out is None else out

    CausalBias._dispatch = staticmethod(dispatch)
    try:
        yield
    finally:
        CausalBias._dispatch = original


#: an op is re-run only where its curve price is at most this and its argument tensors hold at most
#: REPLAY_MAX_BYTES: a 7B model's ops stay on the curves (re-running them took 30 s of a 32 s estimate)
REPLAY_MAX_S = 0.01
REPLAY_MAX_BYTES = 2**25
_REPLAYED: dict = {}


def op_spec(args, kwargs):
    """An op's arguments as a tree holding no tensor (each ``(shape, stride, dtype)``); None where they
    cannot be remade (a process group) or hold more than REPLAY_MAX_BYTES (never re-run: not kept)."""
    leaves, tree = tree_flatten((args, kwargs))
    spec = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            spec.append(("tensor", tuple(x.shape), tuple(x.stride()), x.dtype))
        elif isinstance(x, torch.device):
            spec.append(("device",))
        elif x is None or isinstance(x, int | float | bool | str | torch.dtype | torch.layout | torch.memory_format):
            spec.append(("value", x))
        else:
            return None
    if _tensor_bytes(spec) > REPLAY_MAX_BYTES:
        return None
    return tree, tuple(spec)


def _tensor_bytes(leaves) -> int:
    return sum(math.prod(leaf[1]) * leaf[3].itemsize for leaf in leaves if leaf[0] == "tensor")


def _remade(leaf, copies: int = 1) -> list:
    """``copies`` arguments like ``leaf`` (a value's are the value), each tensor over its own storage."""
    if leaf[0] == "device":
        return [torch.device("cpu")] * copies
    if leaf[0] == "value":
        return [leaf[1]] * copies
    shape, stride, dtype = leaf[1:]
    size = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    if dtype.is_floating_point:  # positive values: a sqrt or log takes its usual path, not NaN's
        storage = (torch.rand(size) + 0.5).to(dtype)
    else:  # index 0 is in range for every gather, embedding and loss target
        storage = torch.zeros(size, dtype=dtype)
    return [(storage if i == 0 else storage.clone()).as_strided(shape, stride) for i in range(copies)]


def replay_seconds(func, spec, threads: int = 1, min_s: float = 0.003) -> float | None:
    """Seconds ``func`` takes here on fresh tensors of ``spec``'s shapes (:func:`op_spec`), memoised;
    None where it cannot run so (the op is then priced by its curve).

    Why: on a CPU a memory-bound op's time depends on the op more than on its bytes (measured: gelu's
    backward, a layer norm, a log-softmax 4-7x an add moving as many), an attention's on its shape
    and mask; the estimate runs where the trial will, so it asks the CPU itself.

    The op is timed in turns over enough copies of its arguments to hold twice the last-level cache
    (:func:`replay_copies`): each call reads tensors the others have pushed out of the cache, as in a
    training step, where an op's tensors were last touched many ops before (a weight, a whole step
    before), while the framework's code stays warm as it does there. Measured on this project's 2-core
    CI machine, a user GPT (d 256, 4 blocks): one process's step priced from one call looped on its
    own arguments was 24% (bf16) and 11% (fp32) under the trial's."""
    tree, leaves = spec
    key = (str(func), leaves, threads)
    if key in _REPLAYED:
        return _REPLAYED[key]
    seconds = None
    if _tensor_bytes(leaves) <= REPLAY_MAX_BYTES:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            seconds = _timed_in_turns(func, tree, leaves, replay_copies(_tensor_bytes(leaves)), min_s)
        except Exception:  # noqa: BLE001 - an op that needs real values (indices, shapes): its curve
            seconds = None
        finally:
            torch.set_num_threads(before)
    _REPLAYED[key] = seconds
    return seconds


def _timed_in_turns(func, tree, leaves, copies: int, min_s: float) -> float:
    """Seconds per call of ``func`` called on each of ``copies`` argument sets in turn (after one
    untimed round), rounds repeated until ``min_s`` has passed."""
    columns = [_remade(leaf, copies) for leaf in leaves]
    calls = [tree_unflatten([column[i] for column in columns], tree) for i in range(copies)]
    with torch.no_grad():
        for args, kwargs in calls:
            func(*args, **kwargs)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_s or n < copies:
            for args, kwargs in calls:
                func(*args, **kwargs)
            n += copies
    return (time.perf_counter() - start) / n


#: at most this many argument sets per replayed op (a tiny op's sets then fit a core's own cache, as
#: its tensors do in a step)
REPLAY_MAX_COPIES = 1024


def replay_copies(nbytes: int) -> int:
    """How many argument sets of ``nbytes`` hold twice the last-level cache (1 to REPLAY_MAX_COPIES)."""
    return max(1, min(REPLAY_MAX_COPIES, math.ceil(2 * last_level_cache_bytes() / max(nbytes, 1))))


@functools.cache
def last_level_cache_bytes(default: int = 2**25) -> int:
    """The largest CPU cache's size (Linux sysfs), or ``default`` (32 MiB) where it cannot be read."""
    from pathlib import Path

    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)

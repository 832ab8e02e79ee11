"""Attention over a sequence split across ranks, and how a model's attention is routed to it.

Two ways in, both scoped to the one model (no global function is patched):

* a transformers model that supports the attention interface gets ``config._attn_implementation``
  = :data:`IMPLEMENTATION`, a function registered once in transformers' ``AttentionInterface``
  that reads the split from the attention module it is called with (:data:`ATTR`); the model then
  builds no mask (the function applies the causal mask over global positions itself);
* any other model: calls to ``torch.nn.functional.scaled_dot_product_attention`` inside its
  forward are intercepted by a ``TorchFunctionMode`` entered by a forward pre-hook and left by a
  forward hook (also when the forward raises), so the same function elsewhere is untouched.

A forward that reached attention through neither way is a ConfigError after it runs: each rank
would have attended to its own part of the sequence only.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from composable_atorch.errors import ConfigError
from composable_atorch.runtime.sequence import is_probing
from composable_atorch.transforms.parallel.sequence.check import check_heads, check_ring
from composable_atorch.transforms.parallel.sequence.comm import gather_sequence, heads_to_sequence, sequence_to_heads
from composable_atorch.transforms.parallel.sequence.ring import ring_attention
from composable_atorch.transforms.parallel.sequence.shard import (
    all_positions,
    check_own_parts,
    chunk_bounds,
    chunk_positions,
)

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias

#: attribute an attention module carries: its :class:`Attend`
ATTR = "_composable_sequence_attend"
#: the name registered in transformers' AttentionInterface
IMPLEMENTATION = "composable_sequence"


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys / values repeated to ``heads`` (transformers' ``repeat_kv`` order)."""
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


@dataclass
class Attend:
    """Attention for one rank of a sequence split: ``kind`` ``"context"`` or ``"ulysses"``."""

    kind: str
    group: Any
    rank: int
    n: int
    who: str
    #: context parallelism's key/value exchange: ``"allgather"`` or ``"ring"`` (:mod:`.ring`)
    rotation: str = "allgather"
    calls: int = 0
    #: the loss function :func:`.loss.check_loss` last found to train the split as one process
    #: (its code object, or the object itself)
    loss_checked: Any = None
    #: the autograd node and shape of the model's last output, kept for the loss guard
    #: (:class:`.loss.SequenceLossGuard`) until it has checked one loss
    output: tuple | None = None
    watch_output: bool = True

    @property
    def balanced(self) -> bool:
        return self.kind == "context"

    def __deepcopy__(self, memo):
        """A copy of the model (a probe's zero-weight replica) attends locally: it must not join the
        group's collectives, which the other ranks may not be running."""
        return Attend(kind=self.kind, group=None, rank=0, n=1, who=self.who, rotation=self.rotation, watch_output=False)

    def watch(self, output) -> None:
        """Keep the autograd node of a training forward's output (logits, a tensor, a tuple's first tensor)."""
        out = getattr(output, "logits", output)
        if isinstance(out, tuple | list):
            out = next((o for o in out if isinstance(o, torch.Tensor)), None)
        if isinstance(out, torch.Tensor) and out.grad_fn is not None and out.dim() >= 2:
            self.output = (out.grad_fn, tuple(out.shape))

    def __call__(
        self, q, k, v, *, causal: bool, scale=None, dropout: float = 0.0, window=None, softcap=None, sinks=None
    ) -> torch.Tensor:
        """``q, k, v``: ``(batch, heads, local seq, dim)`` -> this rank's output, same shape as ``q``.

        ``window`` (a sliding window), ``softcap`` (logits capped by ``tanh``) and ``sinks`` (one
        learned logit per head in the softmax's denominator) are a layer's attention features, each
        computed over the whole sequence's global positions as the model's own eager attention does."""
        self.calls += 1
        scale = q.size(-1) ** -0.5 if scale is None else scale
        if self.n == 1 or is_probing():  # a probe forward (a transform's check) runs as one process
            k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
            pos = torch.arange(q.size(2), device=q.device)
            return attend_exact(q, k, v, pos, pos, causal, scale, dropout, window, softcap, sinks)
        if self.kind == "context":
            return self._context(q, k, v, causal, scale, dropout, window, softcap, sinks)
        return self._ulysses(q, k, v, causal, scale, dropout, window, softcap, sinks)

    def _context(self, q, k, v, causal, scale, dropout, window, softcap, sinks):
        if self.rotation == "ring":
            check_ring(self.who, dropout=dropout, softcap=softcap, sinks=sinks)
            k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
            return ring_attention(q, k, v, self.group, self.rank, self.n, causal=causal, scale=scale, window=window)
        # all-gather of keys and values (exact; one collective, then attention over global positions)
        k_all, v_all = gather_sequence(k, self.group, self.n), gather_sequence(v, self.group, self.n)
        length = q.size(2)
        k_pos = all_positions(self.n, length, True, q.device)
        if causal and window is None and softcap is None and sinks is None:
            bounds = chunk_bounds(self.rank, self.n, length, True)
            return attend_causal_chunks(q, k_all, v_all, k_pos, bounds, scale, dropout)
        k_all, v_all = _repeat_heads(k_all, q.size(1)), _repeat_heads(v_all, q.size(1))
        q_pos = chunk_positions(self.rank, self.n, length, True, q.device)
        return attend_exact(q, k_all, v_all, q_pos, k_pos, causal, scale, dropout, window, softcap, sinks)

    def _ulysses(self, q, k, v, causal, scale, dropout, window, softcap, sinks):
        heads = q.size(1)
        check_heads(heads, self.n, self.who)
        if k.size(1) % self.n:  # too few key/value heads to split: repeat them first
            k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        qh, kh, vh = (sequence_to_heads(t, self.group, self.n) for t in (q, k, v))
        kh, vh = _repeat_heads(kh, qh.size(1)), _repeat_heads(vh, qh.size(1))
        if sinks is not None:  # this rank's heads (the all-to-all gives rank r the r-th block of heads)
            per = qh.size(1)
            sinks = sinks[self.rank * per : (self.rank + 1) * per]
        pos = torch.arange(qh.size(2), device=q.device)  # whole sequences in order after the all-to-all
        out = attend_exact(qh, kh, vh, pos, pos, causal, scale, dropout, window, softcap, sinks)
        return heads_to_sequence(out, self.group, self.n)


#: the storage of :func:`lower_right`'s biases: SDPA reads only their variant and lengths
_NO_STORAGE = torch.empty(0, device="meta")


def lower_right(q_len: int, kv_len: int) -> CausalBias:
    """torch's lower-right causal bias (``causal_lower_right(q_len, kv_len)``: query ``i`` sees keys up to
    ``kv_len - q_len + i``), which SDPA runs as the flash kernel's causal mode on CUDA and materializes
    elsewhere. Built over an empty meta tensor: the public factory gives the bias a ``[2, q_len, kv_len]``
    float32 host tensor as its storage (34 GB at 16k x 262k tokens), and cannot be called under a
    TorchDispatchMode (FakeTensorMode, FlopCounterMode: the raw tensor is already wrapped).
    Imported here: ``torch.nn.attention.bias`` imports dynamo, 0.9 s of every process's start."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    bias = torch.Tensor._make_subclass(CausalBias, _NO_STORAGE)
    bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, q_len, kv_len
    return bias


def attend_causal_chunks(q, k_all, v_all, k_pos, bounds, scale, dropout) -> torch.Tensor:
    """Causal attention of this rank's contiguous query chunks (global ``[start, end)`` each, in local
    order) over the gathered keys, without a mask over them: the keys are put in global order, and chunk
    ``[start, end)`` attends over keys ``[0, end)`` with :func:`lower_right`, what the flash kernel
    computes causally (no masked block). The exact path (:func:`attend_exact`, a ``(local queries, all
    keys)`` mask) stays for what this cannot say: a sliding window (a band, not a lower-right triangle),
    capped logits and sinks (the eager computation, which no fused kernel has)."""
    order = torch.argsort(k_pos)
    keys = _repeat_heads(k_all.index_select(2, order), q.size(1))
    values = _repeat_heads(v_all.index_select(2, order), q.size(1))
    outs, at = [], 0
    for start, end in bounds:
        chunk = q[:, :, at : at + end - start]
        at += end - start
        mask = lower_right(end - start, end)
        kv = keys[:, :, :end], values[:, :, :end]
        outs.append(F.scaled_dot_product_attention(chunk, *kv, attn_mask=mask, dropout_p=dropout, scale=scale))
    return torch.cat(outs, dim=2)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window) -> torch.Tensor | None:
    """``(q, k)`` bool mask over global positions (transformers' causal mask and ``sliding_window_overlay``:
    ``0 <= q - k < window``; ``|q - k| < window`` for a bidirectional window); None when every key is seen."""
    if not causal and window is None:
        return None
    d = q_pos[:, None] - k_pos[None, :]
    mask = d >= 0 if causal else torch.ones(d.shape, dtype=torch.bool, device=d.device)
    if window is not None:
        mask = mask & ((d < window) if causal else (d.abs() < window))
    return mask


def attend_exact(q, k, v, q_pos, k_pos, causal, scale, dropout, window=None, softcap=None, sinks=None):
    """Attention of ``q`` over ``k, v`` (same heads) at the given global positions: fused SDPA when the
    layer has no logit features, else the eager computation (softcapped logits, sink column in the
    softmax, as transformers' Gemma-2 / GPT-OSS eager attention)."""
    mask = visible(q_pos, k_pos, causal, window)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    logits = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).to(logits.dtype).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


# -- transformers' attention interface ------------------------------------------------------------


#: keyword arguments transformers' attention layers pass that change nothing in a training forward
#: without a cache (positions are given globally; the flash-attention-only sequence lengths are unused);
#: ``shift_labels`` / ``num_items_in_batch`` are the loss's, which a causal LM's forward passes on to
#: every layer with its other keywords (the loader's split gives them: :func:`.shard.with_shift_labels`)
_INERT = {
    *("position_ids", "output_attentions", "use_cache", "cache_position", "layer_idx", "head_mask"),
    *("shift_labels", "num_items_in_batch"),
}
#: the per-layer attention features this function computes over the whole sequence
_FEATURES = {"sliding_window", "softcap", "s_aux"}


def sequence_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention-function signature; ``(output (b, s, h, d), None)``.

    The layer's features (``sliding_window``, ``softcap``, ``s_aux`` attention sinks) are computed
    over global positions; any other keyword a layer passes with a value is a ConfigError (it would
    change the attention in a way this split does not know)."""
    attend = getattr(module, ATTR, None)
    if attend is None:
        raise ConfigError(
            "attention implementation",
            IMPLEMENTATION,
            "a model prepared by context_parallel / sequence_parallel (set another config._attn_implementation)",
        )
    unknown = sorted(
        key for key, val in kwargs.items() if key not in _INERT | _FEATURES and val is not None and val is not False
    )
    if unknown and not is_probing():
        raise ConfigError(
            f"{attend.who}: {type(module).__name__} attention arguments",
            unknown,
            "a model whose attention layers pass only sliding_window / softcap / s_aux (these are computed over "
            "the whole sequence; others are not split over ranks)",
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attend(
        query,
        key,
        value,
        causal=bool(causal),
        scale=scaling,
        dropout=dropout,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    return out.transpose(1, 2).contiguous(), None


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """A transformers model whose attention layers dispatch through ``AttentionInterface``."""
    return bool(getattr(model, "_supports_attention_backend", False)) and hasattr(model, "set_attn_implementation")


def route_transformers(model: torch.nn.Module, attend: Attend) -> str:
    """Point the model's attention at :func:`sequence_attention_forward`; returns the replaced name."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(IMPLEMENTATION) is not sequence_attention_forward:
        AttentionInterface.register(IMPLEMENTATION, sequence_attention_forward)
    check_mask_features(model.config, attend)
    if attend.kind == "context" and attend.rotation == "ring":
        for module in model.modules():
            if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "sinks", None), torch.Tensor):
                check_ring(attend.who, sinks=module.sinks)
    before = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            setattr(module, ATTR, attend)
    return before


#: layer kinds whose mask this split builds itself (the attention function gets their window)
_LAYER_TYPES = {"full_attention", "sliding_attention"}


def check_mask_features(config, attend: Attend) -> None:
    """Refuse attention patterns that transformers expresses only in the mask it builds (the split's
    function builds its own mask over global positions, so a pattern it is not told of would be lost):
    chunked attention (Llama-4), layer kinds other than full / sliding, a ring with capped logits."""
    configs = [config, getattr(config, "text_config", None)]
    for c in (c for c in configs if c is not None):
        chunk = getattr(c, "attention_chunk_size", None)
        if chunk is not None:
            raise ConfigError(
                f"{attend.who}: config.attention_chunk_size", chunk, "None: chunked attention is not split over ranks"
            )
        kinds = set(getattr(c, "layer_types", None) or ()) - _LAYER_TYPES
        if kinds:
            raise ConfigError(
                f"{attend.who}: config.layer_types",
                sorted(kinds),
                f"only {sorted(_LAYER_TYPES)}: other layer kinds' masks are not split over ranks",
            )
        if attend.kind == "context" and attend.rotation == "ring":
            check_ring(attend.who, softcap=getattr(c, "attn_logit_softcapping", None))


# -- any model calling scaled_dot_product_attention ---------------------------------------------------


class _SDPAMode(TorchFunctionMode):
    def __init__(self, attend: Attend):
        super().__init__()
        self.attend = attend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(self.attend, *args, **kwargs)
        return func(*args, **kwargs)


def _sdpa(attend, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None:
        raise ConfigError(
            f"{attend.who}: scaled_dot_product_attention attn_mask",
            tuple(attn_mask.shape),
            "None with is_causal=True or False: a mask over the whole sequence is not split over ranks",
        )
    return attend(query, key, value, causal=bool(is_causal), scale=scale, dropout=dropout_p)


def forward_takes(model: torch.nn.Module, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def positions_module(model: torch.nn.Module) -> torch.nn.Module:
    """Where global ``position_ids`` are given: a transformers model's base model (its decoder stack,
    called with keywords by the head model's forward, also when a pipeline stage replaced that
    forward), else the root model."""
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model and forward_takes(base, "position_ids"):
        return base
    return model


class SequenceHooks:
    """The model's forward hooks: global ``position_ids`` (on :func:`positions_module`), the SDPA mode
    and the check that attention was reached (on the root). Probe forwards (:func:`is_probing`) pass."""

    def __init__(self, model: torch.nn.Module, attend: Attend, *, intercept_sdpa: bool, positions: bool):
        self.attend, self.intercept_sdpa, self.positions = attend, intercept_sdpa, positions
        self._modes: list[_SDPAMode] = []
        #: input shapes whose batches were checked to differ over the group (:func:`.shard.check_own_parts`)
        self._checked: set[tuple] = set()
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True, always_call=True)
        if positions:
            positions_module(model).register_forward_pre_hook(self.give_positions, with_kwargs=True)

    def give_positions(self, module, args, kwargs):
        if is_probing() or kwargs.get("position_ids") is not None:
            return args, kwargs
        for t in (args[0] if args else None, kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                pos = chunk_positions(self.attend.rank, self.attend.n, t.size(1), self.attend.balanced)
                kwargs["position_ids"] = pos.to(t.device).unsqueeze(0).expand(t.size(0), -1)
                break
        return args, kwargs

    def before(self, module, args, kwargs):
        self.attend.calls = 0
        if is_probing():
            return args, kwargs
        self._check_own_parts(args, kwargs)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            raise ConfigError(
                f"{self.attend.who}: attention_mask", "with padding", "unpadded (packed) sequences, or no mask"
            )
        if self.intercept_sdpa:
            mode = _SDPAMode(self.attend)
            mode.__enter__()
            self._modes.append(mode)
        return args, kwargs

    def _check_own_parts(self, args, kwargs) -> None:
        """A training forward's token ids, once per input shape: refused if every rank holds the same.
        Float inputs are left alone: a later pipeline stage receives activations (the first stage
        checked the tokens), and torch's pipelining infers shapes from zeros."""
        a = self.attend
        if a.group is None or a.n < 2 or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        for t in (args[0] if args else None, kwargs.get("input_ids")):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                if t.is_floating_point() or isinstance(t, FakeTensor) or t.is_meta or tuple(t.shape) in self._checked:
                    return
                check_own_parts(t, a.group, a.n, a.who, "context" if a.balanced else "sequence")
                self._checked.add(tuple(t.shape))
                return

    def after(self, module, args, kwargs, output):
        if self._modes:
            self._modes.pop().__exit__(None, None, None)
        if self.attend.watch_output and not is_probing():
            self.attend.watch(output)
        if self.attend.calls == 0 and sys.exc_info()[0] is None and not is_probing():
            how = "scaled_dot_product_attention" if self.intercept_sdpa else "transformers' attention interface"
            raise ConfigError(
                f"{self.attend.who}: the model's attention",
                "not reached",
                f"attention through {how} (each rank would attend to its own part of the sequence only); for a "
                "model with hand-written attention, call torch.nn.functional.scaled_dot_product_attention",
            )
        return output

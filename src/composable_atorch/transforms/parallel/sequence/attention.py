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
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from composable_atorch.errors import ConfigError
from composable_atorch.runtime.sequence import is_probing
from composable_atorch.transforms.parallel.sequence.comm import gather_sequence, heads_to_sequence, sequence_to_heads
from composable_atorch.transforms.parallel.sequence.ring import ring_attention
from composable_atorch.transforms.parallel.sequence.shard import all_positions, chunk_positions

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

    @property
    def balanced(self) -> bool:
        return self.kind == "context"

    def __deepcopy__(self, memo):
        """A copy of the model (a probe's zero-weight replica) attends locally: it must not join the
        group's collectives, which the other ranks may not be running."""
        return Attend(kind=self.kind, group=None, rank=0, n=1, who=self.who, rotation=self.rotation)

    def __call__(
        self, q, k, v, *, causal: bool, scale=None, dropout: float = 0.0, window=None, softcap=None, sinks=None
    ) -> torch.Tensor:
        """``q, k, v``: ``(batch, heads, local seq, dim)`` -> this rank's output, same shape as ``q``.

        ``window`` (transformers' ``sliding_window``: a query attends to the keys less than ``window``
        positions behind it), ``softcap`` (Gemma-2's ``softcap * tanh(logits / softcap)``) and
        ``sinks`` (GPT-OSS's per-head logit joining every softmax's denominator) are the per-layer
        attention features transformers passes; each is applied over global positions."""
        self.calls += 1
        extra = Features(window=window, softcap=softcap, sinks=sinks)
        if self.n == 1 or is_probing():  # a probe forward (a transform's check) runs as one process
            k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
            return attention(q, k, v, None, None, causal, scale, dropout, extra)
        if self.kind == "context":
            return self._context(q, k, v, causal, scale, dropout, extra)
        return self._ulysses(q, k, v, causal, scale, dropout, extra)

    def _context(self, q, k, v, causal, scale, dropout, extra):
        length = q.size(2)
        if self.rotation == "ring":
            if dropout:
                raise ConfigError(
                    f"{self.who}: attention dropout",
                    dropout,
                    "0.0, or context_parallel(rotation='allgather'): the ring merges partial softmaxes and has no "
                    "dropout on its probabilities",
                )
            unsupported = extra.beyond_ring(self.n * length)
            if unsupported:
                raise ConfigError(
                    f"{self.who}: the model's attention {unsupported}",
                    "with rotation='ring'",
                    "context_parallel(rotation='allgather'), or sequence_parallel (Ulysses): the ring merges "
                    "partial softmaxes block by block and computes plain causal attention only",
                )
            k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
            return ring_attention(q, k, v, self.group, self.rank, self.n, causal=causal, scale=scale)
        # all-gather of keys and values (exact; one collective, then one fused attention)
        k_all = _repeat_heads(gather_sequence(k, self.group, self.n), q.size(1))
        v_all = _repeat_heads(gather_sequence(v, self.group, self.n), q.size(1))
        q_pos = chunk_positions(self.rank, self.n, length, True, q.device)
        k_pos = all_positions(self.n, length, True, q.device)
        return attention(q, k_all, v_all, q_pos, k_pos, causal, scale, dropout, extra)

    def _ulysses(self, q, k, v, causal, scale, dropout, extra):
        heads = q.size(1)
        check_heads(heads, self.n, self.who)
        if k.size(1) % self.n:  # too few key/value heads to split: repeat them first
            k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        qh, kh, vh = (sequence_to_heads(t, self.group, self.n) for t in (q, k, v))
        kh, vh = _repeat_heads(kh, qh.size(1)), _repeat_heads(vh, qh.size(1))
        mine = heads // self.n  # this rank's heads: rank r holds heads r*h/n .. (r+1)*h/n - 1
        extra = extra.heads(self.rank * mine, (self.rank + 1) * mine)
        out = attention(qh, kh, vh, None, None, causal, scale, dropout, extra)
        return heads_to_sequence(out, self.group, self.n)


@dataclass(frozen=True)
class Features:
    """The per-layer attention features a transformers attention module passes (None: not used)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def heads(self, start: int, stop: int) -> Features:
        """The features for heads ``start .. stop - 1`` (sinks are per head)."""
        sinks = None if self.sinks is None else self.sinks[start:stop]
        return Features(window=self.window, softcap=self.softcap, sinks=sinks)

    def beyond_ring(self, total: int) -> str:
        """What the ring cannot compute, for sequences of ``total`` tokens ('' when nothing)."""
        found = []
        if self.window is not None and self.window < total:
            found.append(f"sliding_window {self.window} (< the sequence's {total} tokens)")
        if self.softcap is not None:
            found.append(f"softcap {self.softcap}")
        if self.sinks is not None:
            found.append("attention sinks (s_aux)")
        return ", ".join(found)


def attention(q, k, v, q_pos, k_pos, causal: bool, scale, dropout: float, extra: Features) -> torch.Tensor:
    """Attention of queries at global positions ``q_pos`` over keys at ``k_pos`` (same heads):
    ``scaled_dot_product_attention`` with the causal / sliding-window mask, or, with a softcap or
    sinks, the same computation spelled out as transformers' eager attention does it. ``q_pos`` None:
    queries and keys both at ``0 .. len-1`` (Ulysses, a probe), where plain causal attention needs no
    mask (SDPA's fused kernels, no len x len mask in memory)."""
    plain = extra.window is None and extra.softcap is None and extra.sinks is None
    if q_pos is None:
        if plain:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scale)
        q_pos = k_pos = torch.arange(q.size(2), device=q.device)
    mask = None
    if causal or extra.window is not None:
        offset = q_pos[:, None] - k_pos[None, :]
        mask = offset >= 0 if causal else torch.ones_like(offset, dtype=torch.bool)
        if extra.window is not None:
            mask = mask & (offset < extra.window)
    if extra.softcap is None and extra.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    logits = torch.matmul(q, k.transpose(-2, -1)) * scale
    if extra.softcap is not None:
        logits = torch.tanh(logits / extra.softcap) * extra.softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    if extra.sinks is not None:
        sink = extra.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)
        both = torch.cat([logits, sink], dim=-1)
        probs = F.softmax(both - both.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    else:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs.to(v.dtype), v)


def check_heads(heads: int, n: int, who: str) -> None:
    if heads % n:
        raise ConfigError(
            f"{who}: attention heads", heads, f"a multiple of the sequence size {n} (Ulysses splits the heads)"
        )


# -- transformers' attention interface ------------------------------------------------------------


def sequence_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention-function signature; ``(output (b, s, h, d), None)``."""
    attend = getattr(module, ATTR, None)
    if attend is None:
        raise ConfigError(
            "attention implementation",
            IMPLEMENTATION,
            "a model prepared by context_parallel / sequence_parallel (set another config._attn_implementation)",
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
    before = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            setattr(module, ATTR, attend)
    return before


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

    def after(self, module, args, kwargs, output):
        if self._modes:
            self._modes.pop().__exit__(None, None, None)
        if self.attend.calls == 0 and sys.exc_info()[0] is None and not is_probing():
            how = "scaled_dot_product_attention" if self.intercept_sdpa else "transformers' attention interface"
            raise ConfigError(
                f"{self.attend.who}: the model's attention",
                "not reached",
                f"attention through {how} (each rank would attend to its own part of the sequence only); for a "
                "model with hand-written attention, call torch.nn.functional.scaled_dot_product_attention",
            )
        return output

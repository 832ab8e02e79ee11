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

    def __call__(self, q, k, v, *, causal: bool, scale=None, dropout: float = 0.0) -> torch.Tensor:
        """``q, k, v``: ``(batch, heads, local seq, dim)`` -> this rank's output, same shape as ``q``."""
        self.calls += 1
        if self.n == 1 or is_probing():  # a probe forward (a transform's check) runs as one process
            k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scale)
        if self.kind == "context":
            return self._context(q, k, v, causal, scale, dropout)
        return self._ulysses(q, k, v, causal, scale, dropout)

    def _context(self, q, k, v, causal, scale, dropout):
        if self.rotation == "ring":
            if dropout:
                raise ConfigError(
                    f"{self.who}: attention dropout",
                    dropout,
                    "0.0, or context_parallel(rotation='allgather'): the ring merges partial softmaxes and has no "
                    "dropout on its probabilities",
                )
            k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
            return ring_attention(q, k, v, self.group, self.rank, self.n, causal=causal, scale=scale)
        # all-gather of keys and values (exact; one collective, then one fused attention)
        k_all = _repeat_heads(gather_sequence(k, self.group, self.n), q.size(1))
        v_all = _repeat_heads(gather_sequence(v, self.group, self.n), q.size(1))
        mask = None
        if causal:
            length = q.size(2)
            q_pos = chunk_positions(self.rank, self.n, length, True, q.device)
            k_pos = all_positions(self.n, length, True, q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout, scale=scale)

    def _ulysses(self, q, k, v, causal, scale, dropout):
        heads = q.size(1)
        check_heads(heads, self.n, self.who)
        if k.size(1) % self.n:  # too few key/value heads to split: repeat them first
            k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        qh, kh, vh = (sequence_to_heads(t, self.group, self.n) for t in (q, k, v))
        kh, vh = _repeat_heads(kh, qh.size(1)), _repeat_heads(vh, qh.size(1))
        out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout, is_causal=causal, scale=scale)
        return heads_to_sequence(out, self.group, self.n)


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
    out = attend(query, key, value, causal=bool(causal), scale=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """A transformers model whose attention layers dispatch through ``AttentionInterface``."""
    return bool(getattr(model, "_supports_attention_backend", False)) and hasattr(model, "set_attn_implementation")


def route_transformers(model: torch.nn.Module, attend: Attend) -> str:
    """Point the model's attention at :func:`sequence_attention_forward`; returns the replaced name."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(IMPLEMENTATION) is not sequence_attention_forward:
        AttentionInterface.register(IMPLEMENTATION, sequence_attention_forward)
    window = getattr(model.config, "sliding_window", None)
    if window is not None and getattr(model.config, "use_sliding_window", True):
        raise ConfigError(
            f"{attend.who}: config.sliding_window", window, "None: sliding-window masks are not split over ranks yet"
        )
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

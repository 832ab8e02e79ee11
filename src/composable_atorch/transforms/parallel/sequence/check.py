"""The numerical guard of a sequence split: does each rank's part compute what the whole model does?

The split reroutes attention (every rank attends over the whole sequence through all-gather, a
ring or Ulysses' all-to-all) and gives global positions; everything else in the model runs on the
rank's own tokens. A model that mixes tokens anywhere else (a causal convolution, a state-space or
linear-attention layer: Mamba, Jamba, LFM2, Qwen3-Next), or whose attention takes a bias or feature
the split does not carry over (T5's relative bias, ALiBi inside a hand-written attention), would
train silently on 1/n-long sequences. So before any step, one probe sequence (batch 1, the
loader's length up to ``MAX_PROBE_TOKENS``) runs through the whole model on every rank and through
the split model on each rank's part; the parts must equal the whole's rows at the same global positions, else
:class:`~composable_atorch.errors.SequenceSplitMismatchError`.

:func:`takes_shift_labels`: whether a transformers causal LM given ``labels`` computes its loss from the
``shift_labels`` and ``num_items_in_batch`` the loader's split gives it (transformers' ``ForCausalLMLoss``
does; a family that shifts by hand or adds other terms does not), so its ``labels`` batches can train.

:func:`check_ring` / :func:`check_heads`: the attention features the ring cannot merge, and Ulysses'
head count, refused before any step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from composable_atorch.errors import CompositionError, ConfigError, SequenceSplitMismatchError
from composable_atorch.transforms.numerics import evaluating, output_tensor, tolerance
from composable_atorch.transforms.parallel.sequence.shard import IGNORE_INDEX, NUM_ITEMS, SHIFT_LABELS, chunk_positions

#: probe length when the loader does not say (per part: enough for a causal mask to matter)
PARTS_TOKENS = 8
#: the longest probe: the whole model runs it on every rank (no grad, batch 1), which must fit where
#: the sequences a split is for (32k-256k tokens) do not
MAX_PROBE_TOKENS = 2048


def _tokens(model: nn.Module, length: int):
    """``(args, kwargs)`` of one probe sequence of ``length`` tokens, the same on every rank, or None."""
    generator = torch.Generator().manual_seed(1234)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    cfg, main = getattr(model, "config", None), getattr(model, "main_input_name", None)
    if cfg is not None and main == "input_ids" and not getattr(cfg, "is_encoder_decoder", False):
        vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        if vocab < 2:
            return None
        ids = torch.randint(1, vocab, (1, length), generator=generator).to(device)
        return (), {"input_ids": ids}
    if cfg is not None:
        return None
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Linear)), None)
    if isinstance(first, nn.Embedding):
        return (torch.randint(1, max(first.num_embeddings, 2), (1, length), generator=generator).to(device),), {}
    if isinstance(first, nn.Linear):
        x = torch.randn(1, length, first.in_features, generator=generator)
        return (x.to(device, first.weight.dtype),), {}
    return None


def _skip_reason(model: nn.Module) -> str:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    params = list(model.parameters())
    if not params or any(p.is_meta or hasattr(p, "to_local") for p in params):
        return "weights not materialized or already distributed (tensor parallel checks its own plan)"
    if detect_fake_mode() is not None or any(isinstance(p, FakeTensor) for p in params):
        return "fake tensors: the plan is being estimated, not run"
    return ""


def reference(model: nn.Module, length: int | None, n: int):
    """The whole model's output on the probe (``((args, kwargs), output)``), or ``(None, why not)``.
    Called on every rank before the split changes the model."""
    why = _skip_reason(model)
    if why:
        return None, f"numerical check skipped ({why})"
    length = min(length or PARTS_TOKENS * 2 * n, MAX_PROBE_TOKENS)
    length -= length % (2 * n)
    probe = _tokens(model, length)
    if probe is None:
        return None, "numerical check skipped (no probe sequence could be built for this model's input)"
    args, kwargs = probe
    try:
        with evaluating(model):
            out = output_tensor(model(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the model does not take the probe: nothing to compare
        return None, f"numerical check skipped (the model does not run on a probe sequence: {type(e).__name__})"
    if out is None or out.dim() < 2 or out.size(1) != length:
        return None, "numerical check skipped (the forward returns no per-token floating output)"
    return (probe, out), ""


def compare(model: nn.Module, ref, *, group, rank: int, n: int, balanced: bool, who: str, shard) -> str:
    """Run the split ``model`` on this rank's part of the probe and compare it with the whole model's
    rows at the same global positions; every rank of ``group`` agrees on the verdict."""
    (args, kwargs), want = ref
    length = want.size(1)
    args, kwargs = shard((args, kwargs), length)
    try:
        with evaluating(model):
            got = output_tensor(model(*args, **kwargs))
    except CompositionError:
        raise  # a typed refusal from the split attention itself (e.g. a feature the ring cannot compute)
    index = chunk_positions(rank, n, length // n, balanced, device=want.device)
    want = want.index_select(1, index)
    if got is None or got.shape != want.shape:
        diff = torch.tensor(float("inf"))
    else:
        diff = (got - want).abs().max().cpu()
    scale = max(float(want.abs().max()), 1.0)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    tol = tolerance(model) * scale
    rel = float(diff) / scale
    if not float(diff) <= tol:
        raise SequenceSplitMismatchError(
            who,
            f"with each rank holding 1/{n} of the sequence the model's output on a probe sequence differs from "
            f"the whole model's at the same positions (largest difference {rel:.3g} of the output's scale, "
            f"tolerance {tol / scale:.1g}): the model mixes tokens outside the attention the split reroutes (a "
            "convolution over time, a state-space / linear-attention layer, an attention bias or a hand-written "
            "attention), or reads positions other than the position_ids it is given, so training would silently "
            "train on parts of sequences",
            "train this model without a sequence split (fsdp / tensor_parallel for memory), or route every "
            "token-mixing step through torch.nn.functional.scaled_dot_product_attention (a plain model) or "
            "transformers' attention interface",
        )
    return f"split output checked against the whole model's on a probe sequence (difference {rel:.1g} of its scale)"


def takes_shift_labels(model: nn.Module, *, group, n: int, length: int | None, shard) -> bool | None:
    """Does the split ``model`` given ``labels`` report the cross-entropy of its own logits against the
    ``shift_labels`` the loader's split makes, over its ``num_items_in_batch``? One probe batch (batch
    1, 4 tokens per chunk) split as the loader splits it (``shard(batch)``); every rank of ``group``
    agrees on the answer. None where no probe runs (not a transformers LM, weights not materialized,
    fake or distributed: ``labels`` are then refused)."""
    if _skip_reason(model):
        return None
    length = min(length or 8 * n, 8 * n)
    length -= length % (2 * n)
    probe = _tokens(model, length) if length else None
    if probe is None or "input_ids" not in probe[1]:  # a transformers LM's probe is its input_ids keyword
        return None
    ids = probe[1]["input_ids"]
    batch = shard({"input_ids": ids, "labels": ids})
    diff = torch.tensor(float("inf"))
    try:
        with evaluating(model):
            out = model(**batch)
        logits = output_tensor(out)
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            batch[SHIFT_LABELS].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        want = total / batch[NUM_ITEMS]
        diff = ((out.loss.detach().float() - want).abs() / want.abs().clamp(min=1.0)).cpu()
    except Exception:  # noqa: BLE001 - the model does not take the keywords (TypeError) or reports no loss
        pass
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return bool(float(diff) <= 1e-5)


def check_ring(who: str, *, dropout=0.0, softcap=None, sinks=None) -> None:
    """What the ring's merged partial softmaxes cannot compute (the all-gather rotation can)."""
    for name, value, why in (
        ("attention dropout", dropout, "no dropout on its probabilities"),
        ("attention logit softcapping", softcap, "CPU flash blocks without a logit cap"),
        ("attention sinks", sinks, "no sink term in its merged denominators"),
    ):
        if isinstance(value, torch.Tensor) or value:
            shown = f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else value
            raise ConfigError(
                f"{who}: {name}",
                shown,
                f"context_parallel(rotation='allgather') or sequence_parallel: the ring merges partial softmaxes "
                f"and has {why}" + ("" if name != "attention dropout" else " (or attention dropout 0.0)"),
            )


def check_heads(heads: int, n: int, who: str) -> None:
    if heads % n:
        raise ConfigError(
            f"{who}: attention heads", heads, f"a multiple of the sequence size {n} (Ulysses splits the heads)"
        )

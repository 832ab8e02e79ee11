"""What context parallelism and Ulysses share: the loader's sequence split, the routing of the
model's attention, global positions and the gradient sync over the split's group.

Gradients: each rank's loss is its part's mean over equal numbers of tokens, and the
collectives' backward sends every rank the gradients of all ranks' losses for its activations,
so the mean of the group's gradients is the gradient of the whole sequence's mean loss (what one
process computes). That mean is taken before the optimizer step by an all-reduce over the group
(:class:`DataGradSync`); the data dimension is synchronized by ddp / fsdp as without the split.

With model parallelism: the split is applied after ``tensor_parallel`` (it routes each rank's
heads; the reported loss is averaged over data x the split's group: the parallel context's loss
group), and before ``pipeline_parallel`` (``mixed_parallel`` expands into both, the split between them),
whose probe forwards run with the split inert
(:func:`composable_atorch.runtime.sequence.probing`) and whose own loss report averages over the
split's group; transformers models get their global positions at the base model, which a
pipeline stage still calls with keywords.

The search's options for both (:func:`split_options`): a split is proposed where it can train the
model (attention, global positions) and where it pays (long sequences, activations outweighing the
state a split leaves whole: :func:`split_refused`).
"""

from __future__ import annotations

import functools
from typing import Any

from composable_atorch.core.context import NotOffered, SearchContext
from composable_atorch.core.contract import Conflict, Order
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.loader import first_length, rebuild_loader
from composable_atorch.transforms.parallel.sequence import check as split_check
from composable_atorch.transforms.parallel.sequence.attention import (
    Attend,
    SequenceHooks,
    forward_takes,
    positions_module,
    route_transformers,
    uses_attention_interface,
)
from composable_atorch.transforms.parallel.sequence.check import check_heads
from composable_atorch.transforms.parallel.sequence.loss import SPLIT_ATTR, SequenceLossGuard, check_loss
from composable_atorch.transforms.parallel.sequence.recompute import intercept_checkpointed
from composable_atorch.transforms.parallel.sequence.shard import DataSignals, ShardCollate, check_length, shard_batch
from composable_atorch.transforms.parallel.shared.options import layout_option
from composable_atorch.transforms.parallel.shared.sync import DataGradSync, broadcast_local, parallel_context

#: the kind a split records in the parallel context's registry of what was applied to which module
SPLIT_KIND = "sequence_split"

NOT_WITH_MODEL_PARALLEL = "is not built together with {other} in this version (untested: {why})"


def model_parallel_conflicts(who: str) -> tuple[Conflict, ...]:
    """Refusals with the families it is not built with yet (each names the true reason)."""
    whys = {
        "sequence_parallel" if who == "context_parallel" else "context_parallel": "both split every sequence",
        "ds_3d_parallel": "DeepSpeed's pipeline engine does not see the loader split",
    }
    return tuple(
        Conflict(other, f"{who} " + NOT_WITH_MODEL_PARALLEL.format(other=other, why=why), f"drop {other} or {who}")
        for other, why in whys.items()
    )


def after_tensor_parallel(who: str) -> Order:
    """The split applies to the tensor-parallel model: the tensor planner traces the user's forward
    untouched, and the split routes the attention of the sharded model (each rank's heads)."""
    return Order(
        "tensor_parallel",
        f"{who} routes the attention of the tensor-sharded model (each rank's heads); tensor_parallel's planner "
        "traces the user's forward untouched",
    )


def loss_note(pc) -> str:
    """explain()'s line for the group train_step averages the reported loss over (derived from the layout)."""
    names = pc.loss_dims()
    return f"loss reported as the mean over {' x '.join(names)} ({pc.loss_group()[1]} ranks)"


def _heads(model) -> tuple[int | None, int | None]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def apply_split(
    transform, state: TrainState, ctx: ApplyContext, dim: str, kind: str, positions: bool, rotation: str = "allgather"
) -> TrainState:
    """Split every sequence over the ``dim`` dimension of the mesh and route attention (``kind``)."""
    who = transform.name
    pc = parallel_context(state, who)
    n = pc.layout.size(dim)
    if n == 1 or not pc.distributed:
        why = "no process group" if not pc.distributed else f"a {dim} dimension of 1 ({pc.layout.describe()})"
        state.note(who, f"{why}: every rank holds whole sequences, model left as it is")
        return state
    model, balanced = state.model, kind == "context"
    # -- every check before any change --
    interface = uses_attention_interface(model)
    if kind == "ulysses" and interface:
        check_heads(_heads(model)[0] or 0, n, who)
    if positions and not forward_takes(model, "position_ids"):
        raise ConfigError(
            f"{who}: {type(model).__name__}.forward",
            "no position_ids argument",
            "a forward(tokens, position_ids=None) that uses the positions it is given (each rank holds a part of "
            f"the sequence), or {who}(positions=False) for a model without positions",
        )
    pipelined = ctx.find("pipeline_parallel") is not None or pc.layout.size("pipeline") > 1
    if positions and pipelined and positions_module(model) is model:
        raise ConfigError(
            f"{who} with pipeline_parallel",
            type(model).__name__,
            "a transformers model (its base model takes position_ids from the head model's forward), or "
            f"{who}(positions=False) for a model without positions: a pipeline stage calls the model's forward with "
            "the tokens or the received activation only, so the global position_ids cannot be given to it",
        )
    length = first_length(state.loader) if state.loader is not None else None
    if length is not None:
        check_length(length, n, balanced, who)
    # -- the changes --
    mesh = pc.mesh[dim]
    group = mesh.get_group()
    rank = mesh.get_local_rank()
    attend = Attend(kind=kind, group=group, rank=rank, n=n, who=who, rotation=rotation)
    broadcast_local(model, group)
    ref, skipped = split_check.reference(model, length, n)
    if interface:
        before = route_transformers(model, attend)
        state.note(who, f"attention: transformers' attention interface ({before!r} -> {route_name()!r})")
    else:
        state.note(who, "attention: calls to scaled_dot_product_attention inside the model's forward intercepted")
        checkpointed = ctx.find("checkpoint")
        if checkpointed is not None:
            blocks = intercept_checkpointed(model, attend, checkpointed.targets)
            state.note(
                who,
                f"checkpointed blocks ({len(blocks)}) run their forward under the same interception, so backward's "
                "recompute attends over the whole sequence too",
            )
    SequenceHooks(model, attend, intercept_sdpa=not interface, positions=positions)
    if ref is not None:
        skipped = split_check.compare(
            model,
            ref,
            group=group,
            rank=rank,
            n=n,
            balanced=balanced,
            who=who,
            shard=lambda batch, total: shard_batch(batch, rank, n, balanced, who, total),
        )
    state.note(who, skipped)
    pc.applied.record(SPLIT_KIND, model)
    _install(state, pc, model, attend, length)
    state.note(who, loss_note(pc))
    return state


def _install(state: TrainState, pc, model, attend: Attend, length: int | None) -> None:
    """The split's state on the model, its loader split and its optimizer hooks (the loss guard, the
    gradient sync over the group)."""
    who, rank, n, balanced = attend.who, attend.rank, attend.n, attend.balanced
    labels = split_check.takes_shift_labels(
        model,
        group=attend.group,
        n=n,
        length=length,
        shard=lambda batch: shard_batch(batch, rank, n, balanced, who, labels=True),
    )
    if labels is not None:
        state.note(
            who,
            "a batch dict's labels are shifted over the whole sequence by the loader's split (transformers' "
            "shift_labels and num_items_in_batch, checked on a probe batch)"
            if labels
            else "a batch dict with labels is refused (the model does not compute its loss from shift_labels)",
        )
    setattr(model, SPLIT_ATTR, attend)  # for sequence_cross_entropy (a copy of the model gets a local one)
    pc.loss_check = functools.partial(check_loss, attend)  # train_step's check of its loss_fn
    guard = SequenceLossGuard(attend, DataSignals())
    if state.loader is not None:
        loader = rebuild_loader(state.loader)
        loader.collate_fn = ShardCollate(
            state.loader.collate_fn, rank, n, balanced, who, labels=bool(labels), signals=guard.signals
        )
        state.loader = loader
    state.hooks.append(guard)
    state.hooks.append(DataGradSync(model, attend.group, n))


def route_name() -> str:
    from composable_atorch.transforms.parallel.sequence.attention import IMPLEMENTATION

    return IMPLEMENTATION


def group_note(n: int, dim: str) -> str:
    return (
        f"gradients averaged over the {dim} group of {n} before each step (data dimension: ddp / fsdp as usual); "
        "each rank's loss is its part's token mean, so the mean over the group is the whole sequence's when every "
        "part counts the same number of tokens (with targets padded by ignore_index use sequence_cross_entropy(model))"
    )


def seed_size(value: Any, field: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(field, value, "an integer >= 1, or None to read it from parallel_mode")


# -- the search's options ------------------------------------------------------------------------------

#: sequences shorter than this are not split by the search: each rank's chunk would be a handful of
#: tokens, the exchange of keys / values costs more than it saves (torchtitan splits 8k-256k tokens)
LONG_SEQUENCE = 64
#: bytes of model state per parameter byte that a sequence split leaves whole on every rank: the
#: parameter, its gradient and an Adam optimizer's two moments
STATE_PER_PARAMETER = 4


def sliding_window(model) -> int | None:
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    return window if window is not None and getattr(config, "use_sliding_window", True) else None


def split_refused(search: SearchContext, forced: bool) -> str | None:
    """Why the search proposes no sequence split of ``search.model``, or None.

    It needs a ``(batch, sequence)`` tensor, a forward taking ``position_ids`` (each rank holds part of
    the sequence and needs its global positions), no sliding window, and attention (transformers'
    attention interface or ``scaled_dot_product_attention`` calls in the meta forward). Unless the
    user included the kind (``forced``), it must also pay: sequences of :data:`LONG_SEQUENCE` tokens or
    more, and activations per rank (data-parallel) at least the model state a split leaves whole.
    """
    facts = search.model
    length, model = facts.sequence_length, facts.model
    if length is None:
        return "the batch has no (batch, sequence) tensor"
    if not forced and length < LONG_SEQUENCE:
        return f"sequences of {length} tokens (split from {LONG_SEQUENCE} on)"
    if not forward_takes(model, "position_ids"):
        return (
            f"{type(model).__name__}.forward takes no position_ids (each rank holds part of the sequence and needs "
            "its global positions)"
        )
    window = sliding_window(model)
    if window is not None:
        return f"sliding-window attention ({window}) is not split over ranks"
    seen = facts.profile()
    if not uses_attention_interface(model) and not seen.heads:
        return f"no attention found ({seen.error or 'no scaled_dot_product_attention call in its forward'})"
    state = STATE_PER_PARAMETER * facts.parameter_bytes
    if not forced and seen.activation_bytes is not None and seen.activation_bytes // search.env.world_size < state:
        return (
            f"activations {seen.activation_bytes // search.env.world_size / 2**20:.1f} MiB per rank (data-parallel) "
            f"< model state {state / 2**20:.1f} MiB (a sequence split divides activations only)"
        )
    return None


def split_options(step: Transform, dim: str, search: SearchContext, fits, describe) -> tuple:
    """The search's options of ``step`` (splitting over ``dim``): one per degree ``n`` whose data size
    divides the global batch and where ``fits(n, length, heads)``, labelled ``describe(n, data)``; or
    why none (:func:`split_refused`)."""
    if search.model is None or search.env.world_size < 2:
        return ()
    refused = split_refused(search, step.name in search.included)
    if refused is not None:
        return (NotOffered(step.name, refused),)
    facts, world = search.model, search.env.world_size
    seen = facts.profile()
    heads = seen.heads[0] if seen.heads else getattr(getattr(facts.model, "config", None), "num_attention_heads", None)
    return tuple(
        layout_option(dim, n, world, describe(n, world // n), step)
        for n in search.degrees
        if not search.batch_size % (world // n) and fits(n, facts.sequence_length, heads)
    )

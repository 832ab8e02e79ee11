"""The parallel degrees that depend on the model and its batch: sequence splits, experts, hybrid sharding.

A transform offers its search candidates from a :class:`~composable_atorch.core.context.SearchContext`
(world, block classes, batch size). Whether a sequence split or expert parallelism makes sense needs
more than that: the model itself (does it have attention? experts? how many heads?) and a batch (how
long are its sequences, do its activations dominate the memory?). This module reads those here, where
the search holds the model (built on the meta device) and the workload's first batch, and proposes
each degree as one option of the ``parallel_mode`` knob: a layout with the step that uses it,

* ``parallel_mode([("context", n), ("data", rest)]) + context_parallel()`` and
  ``parallel_mode([("sequence", n), ("data", rest)]) + sequence_parallel()`` (ATorch's Ulysses) where
  the model has attention, the sequence is at least :data:`LONG_SEQUENCE` tokens and splits into the
  layout's chunks, and its activations outweigh its parameters, gradients and optimizer state
  (what a sequence split divides; the rest it leaves whole). Ulysses also needs heads divisible by n;
* ``parallel_mode([("expert", n), ("data", rest)]) + expert_parallel()`` where the model has
  mixture-of-experts layers whose expert counts divide by n;
* ``parallel_mode([("zero", per node), ("data", nodes)])`` on several nodes: with fsdp / zero2 from
  the engine knob that is hybrid sharding (HSDP: shard inside a node, replicate across nodes).

Every option is checked with the step's own checks (expert counts, heads, sequence length, the global
batch over the batch dimensions) before it joins the space, and compose() still decides each
combination with the other knobs. Why a degree was not proposed is kept (:attr:`Degrees.notes`) for
the space's description and the report. A user can force a kind with ``SpaceOptions(included=...)``
(the activation rule is then not applied) or drop it with ``excluded``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from composable_atorch.auto.workload import Workload, first_batch
from composable_atorch.core.transform import Transform, lookup
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError, UnknownTransformError

#: the knob these options form (named after the step every option lays out)
KNOB = "parallel_mode"
#: sequences shorter than this are not split: each rank's chunk would be a handful of tokens, the
#: exchange of keys / values costs more than it saves (torchtitan splits 8k-256k token sequences)
LONG_SEQUENCE = 64
#: bytes of model state per parameter byte that a sequence split leaves whole on every rank: the
#: parameter, its gradient and an Adam optimizer's two moments
STATE_PER_PARAMETER = 4
#: the kinds proposed here, by the mesh dimension each one splits
KINDS = {"context_parallel": "context", "sequence_parallel": "sequence", "expert_parallel": "expert"}


@dataclass
class Profile:
    """What one forward of the model on the meta device shows: bytes saved for the backward (not the
    parameters) and the heads of every ``scaled_dot_product_attention`` call; ``error`` when it could
    not run (a data-dependent forward, e.g. a mixture of experts routing tokens)."""

    activation_bytes: int | None = None
    heads: tuple[int, ...] = ()
    error: str | None = None


@dataclass
class Degrees:
    """``options``: label -> the transforms of one option of the ``parallel_mode`` knob; ``pinned``: an
    included kind is among them (no "absent" option); ``notes``: why a degree was not proposed."""

    options: dict[str, tuple[Transform, ...]] = field(default_factory=dict)
    pinned: bool = False
    notes: list[str] = field(default_factory=list)


def sequence_length(batch: Any) -> int | None:
    """The length of the batch's token sequences: dim 1 of its first tensor (``input_ids`` of a dict)."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    if isinstance(batch, list | tuple) and batch:
        batch = batch[0]
    return int(batch.size(1)) if isinstance(batch, torch.Tensor) and batch.dim() >= 2 else None


def profile(model: torch.nn.Module, batch: Any, loss_fn: Callable | None, criterion: Callable | None) -> Profile:
    """One forward (and loss) of ``model`` on the meta device over ``batch``: nothing is allocated."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    class Attention(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.heads: list[int] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention and args and hasattr(args[0], "shape"):
                self.heads.append(int(args[0].shape[1]) if args[0].dim() == 4 else 1)
            return func(*args, **(kwargs or {}))

    params = {id(p) for p in model.parameters()}
    saved = [0]

    def pack(t):
        if id(t) not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    try:
        meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
        mode = Attention()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            if loss_fn is not None:
                loss_fn(model, meta)
            elif criterion is not None and isinstance(meta, list | tuple) and len(meta) == 2:
                criterion(model(meta[0]), meta[1])
            else:
                model(meta)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run on meta: unknown, not an error
        return Profile(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])
    return Profile(saved[0], tuple(mode.heads))


def _kind(name: str) -> type[Transform] | None:
    try:
        return lookup(name)
    except UnknownTransformError:
        return None


def _layout(dim: str, n: int, world: int) -> Transform:
    return lookup("parallel_mode")(groups=((dim, n), ("data", world // n)))


def _uses_attention_interface(model) -> bool:
    return bool(getattr(model, "_supports_attention_backend", False)) and hasattr(model, "set_attn_implementation")


def _takes_positions(model) -> bool:
    import inspect

    params = inspect.signature(model.forward).parameters
    return "position_ids" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _sliding_window(model) -> int | None:
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    return window if window is not None and getattr(config, "use_sliding_window", True) else None


def propose(
    model: torch.nn.Module,
    batch: Any,
    env: Environment,
    *,
    batch_size: int,
    loss_fn: Callable | None = None,
    criterion: Callable | None = None,
    excluded: Iterable[str] = (),
    included: Iterable[str] = (),
) -> Degrees:
    """The ``parallel_mode`` options for ``model`` (meta is fine) on ``batch`` (the first global batch)
    at ``env`` (world size, nodes). ``excluded`` / ``included`` are the space's (canonical kind names)."""
    out = Degrees()
    world = env.world_size
    excluded, included = set(excluded), set(included)
    if world < 2 or KNOB in excluded:
        return out
    wanted = {k for k in KINDS if k not in excluded and _kind(k) is not None}
    forced = wanted & included
    divisors = [n for n in range(2, world + 1) if world % n == 0]

    def add(label: str, *steps: Transform) -> None:
        out.options[label] = steps

    # -- sequence splits --------------------------------------------------------------------------
    split_kinds = [k for k in ("context_parallel", "sequence_parallel") if k in wanted]
    if split_kinds:
        _sequence_options(model, batch, world, divisors, batch_size, loss_fn, criterion, forced, split_kinds, add, out)
    # -- experts ----------------------------------------------------------------------------------
    if "expert_parallel" in wanted:
        expert = _kind("expert_parallel")()
        fitting = []
        for n in divisors:
            try:
                expert.check(model, n)
            except CompositionError as exc:
                if n == 2:
                    out.notes.append(f"expert parallelism not proposed: {getattr(exc, 'problem', exc)}")
                    break
                continue
            fitting.append(n)
        for n in fitting:
            if batch_size % world:
                out.notes.append(f"expert {n} not proposed: the global batch {batch_size} does not split over {world}")
                continue
            add(
                f"expert {n} x data {world // n}: each rank holds 1/{n} of every MoE layer's experts, tokens sent to "
                "their experts by all-to-all",
                _layout("expert", n, world),
                expert,
            )
    # -- hybrid sharding --------------------------------------------------------------------------
    per = env.processes_per_node
    if env.nodes > 1 and per > 1 and not forced:
        if batch_size % world:
            out.notes.append(f"hybrid sharding not proposed: the global batch {batch_size} does not split over {world}")
        else:
            add(
                f"zero {per} x data {env.nodes}: with fsdp / zero2, hybrid sharding (HSDP) inside each node of {per}, "
                f"replicated across {env.nodes} nodes",
                _layout("zero", per, world),
            )
    if forced:  # every plan holds one of the included kinds
        out.options = {k: v for k, v in out.options.items() if any(t.name in forced for t in v)}
    out.pinned = bool(out.options) and bool(forced or KNOB in included)
    return out


def _sequence_options(model, batch, world, divisors, batch_size, loss_fn, criterion, forced, kinds, add, out):
    """The context / Ulysses options (see the module doc for when they are proposed)."""
    length = sequence_length(batch)
    names = " / ".join(kinds)
    if length is None:
        out.notes.append(f"{names} not proposed: the batch has no (batch, sequence) tensor")
        return
    if not forced and length < LONG_SEQUENCE:
        out.notes.append(f"{names} not proposed: sequences of {length} tokens (split from {LONG_SEQUENCE} on)")
        return
    if not _takes_positions(model):
        out.notes.append(
            f"{names} not proposed: {type(model).__name__}.forward takes no position_ids (each rank holds part "
            "of the sequence and needs its global positions)"
        )
        return
    window = _sliding_window(model)
    if window is not None:
        out.notes.append(f"{names} not proposed: sliding-window attention ({window}) is not split over ranks")
        return
    seen = profile_of(model, batch, loss_fn, criterion, out)
    interface = _uses_attention_interface(model)
    if not interface and not seen.heads:
        why = "no scaled_dot_product_attention call in its forward" if seen.error is None else seen.error
        out.notes.append(f"{names} not proposed: no attention found ({why})")
        return
    if not forced:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        state = STATE_PER_PARAMETER * params
        if seen.activation_bytes is not None:
            per_rank = seen.activation_bytes // world
            if per_rank < state:
                out.notes.append(
                    f"{names} not proposed: activations {per_rank / 2**20:.1f} MiB per rank (data-parallel) < model "
                    f"state {state / 2**20:.1f} MiB (a sequence split divides activations only)"
                )
                return
    heads = seen.heads[0] if seen.heads else getattr(getattr(model, "config", None), "num_attention_heads", None)
    for n in divisors:
        if batch_size % (world // n):
            continue
        if "context_parallel" in kinds and length % (2 * n) == 0:
            add(
                f"context {n} x data {world // n}: each rank holds 1/{n} of every sequence (load-balanced chunks), "
                "keys and values all-gathered for attention",
                _layout("context", n, world),
                _kind("context_parallel")(),
            )
        if "sequence_parallel" in kinds and length % n == 0 and heads and heads % n == 0:
            add(
                f"sequence {n} x data {world // n} (Ulysses): each rank holds 1/{n} of every sequence, all-to-all "
                f"to 1/{n} of the heads for attention",
                _layout("sequence", n, world),
                _kind("sequence_parallel")(),
            )


def profile_of(model, batch, loss_fn, criterion, out: Degrees) -> Profile:
    seen = profile(model, batch, loss_fn, criterion)
    if seen.error is not None:
        out.notes.append(f"the meta forward could not run ({seen.error}): activation share not measured")
    return seen


def _groups(plan) -> dict[str, int]:
    pm = next((t for t in plan.transforms if t.name == KNOB), None)
    return dict(pm.groups) if pm is not None else {}


def admit_rule(model: torch.nn.Module, degrees: Degrees, then: Callable | None = None) -> Callable:
    """``admit(plan) -> reason | None`` for the plans these options make with the other knobs: the
    combinations compose() accepts but that train nothing new or are refused when applied.

    * a ``zero`` dimension without fsdp / zero2 / zero1 shards nothing (ddp over data x zero: the
      same training as without it);
    * ``fsdp(hybrid=True)`` where a ``zero x data`` option is offered is the same hybrid sharding
      listed once, by its explicit layout (a trial's processes run on one machine, where the world's
      nodes are not there to take the groups from).
    ``then`` is the next rule.
    """
    layouts = [t for steps in degrees.options.values() for t in steps if t.name == KNOB]
    hybrid_offered = any(dict(t.groups).get("zero", 1) > 1 for t in layouts)

    def admit(plan) -> str | None:
        names = set(plan.names)
        groups = _groups(plan)
        if groups.get("zero", 1) > 1 and not names & {"fsdp", "zero2", "zero1"}:
            return (
                "invalid for the search: the 'zero' dimension shards nothing without fsdp / zero2 / zero1 "
                "(ddp over data x zero is the plan without it)"
            )
        fsdp = next((t for t in plan.transforms if t.name == "fsdp"), None)
        if fsdp is not None and getattr(fsdp, "hybrid", False) and (groups.get("zero", 1) > 1 or hybrid_offered):
            return (
                "invalid for the search: fsdp(hybrid=True) is the hybrid sharding the zero x data layout of the "
                "parallel_mode knob gives; listed once, by that layout"
            )
        return then(plan) if then is not None else None

    return admit


def read_degrees(
    model, workload: Workload, env: Environment, excluded: Iterable[str] = (), included: Iterable[str] = ()
) -> Degrees:
    """The parallel degrees the model and the workload's first batch call for (:func:`propose`);
    none, with the reason as a note, when the batch cannot be read here (the preflight names a
    broken dataset). ``excluded`` / ``included`` are registry names (the space's options, resolved)."""
    try:
        batch = first_batch(workload)
    except Exception as exc:  # noqa: BLE001 - the workload's own error is the preflight's to report
        return Degrees(notes=[f"parallel degrees not read: the first batch failed ({type(exc).__name__}: {exc})"])
    return propose(
        model,
        batch,
        env,
        batch_size=workload.batch_size,
        loss_fn=workload.loss_fn,
        criterion=workload.criterion,
        excluded=set(excluded),
        included=set(included),
    )

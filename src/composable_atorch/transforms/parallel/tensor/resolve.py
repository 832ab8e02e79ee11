"""From plan entries to checked placements, before any weight moves.

:func:`resolve` matches a plan's entries to the model's modules and checks every split: features and
head counts divisible by the degree, then one forward of a zero-weight replica at one rank's shapes
(:func:`verify`), which catches what the shapes alone hide (a norm over the whole q projection, a
convolution or gate reading the full width, a fused projection viewed with a head count fixed at
init). Under the auto plan a pair that fails is kept whole and named, not the model refused
(:func:`keep_failing_pairs`): the pairs are re-checked pattern by pattern in forward order (one check
per pair pattern, whatever the depth), each kept only if the plan with it still passes.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from composable_atorch.transforms.parallel.tensor import graph, lora
from composable_atorch.transforms.parallel.tensor.graph import is_conv1d, is_linear, is_proj, proj_features
from composable_atorch.transforms.parallel.tensor.planner import (
    MANUAL_FORM,
    AutoPlan,
    TensorParallelPlanError,
    name_matches,
)


class Placements(NamedTuple):
    """What a checked plan shards: ``{module: (kind, kwargs)}``, ``{attention: head attrs to divide}``,
    ``{dropout: kind}``, the replicated modules whose gradients are summed, and notes for explain()."""

    shard: dict[str, tuple[str, dict]]
    shrink: dict[str, tuple]
    drops: dict[str, str]
    summed: list[str]
    notes: list[str]


def _match(model: nn.Module, entries) -> tuple[dict, dict, dict, list]:
    modules = [n for n, _ in model.named_modules() if n]
    shard: dict[str, tuple[str, dict]] = {}
    shrink: dict[str, tuple] = {}
    drops: dict[str, str] = {}
    summed: list[str] = []
    unmatched = []
    for kind, pattern, args in entries:
        hits = [n for n in modules if name_matches(n, pattern)]
        if not hits:
            unmatched.append(f"{kind} {pattern!r}")
            continue
        for n in hits:
            if kind == "shrink":
                shrink[n] = tuple(args)
            elif kind in ("replic_drop", "parallel_drop"):
                drops[n] = kind
            elif kind == "grad_sum":
                summed.append(n)
            else:
                shard[n] = (kind, dict(args))
    if unmatched:
        raise TensorParallelPlanError("these plan entries match no module of the model", unmatched)
    if not shard:
        raise TensorParallelPlanError("the plan shards no layer", [e[1] for e in entries], MANUAL_FORM)
    return shard, shrink, drops, summed


def _uneven(modules: dict, shard: dict, shrink: dict, degree: int) -> list[str]:
    """The layers and head counts the degree does not divide."""
    bad = []
    for n, (kind, kw) in shard.items():
        m = modules[n]
        if kind == "vocab":
            if not isinstance(m, nn.Embedding):
                bad.append(f"{n}: shard_vocab needs an nn.Embedding, not {type(m).__name__}")
            elif m.num_embeddings % degree:
                bad.append(f"{n}: vocab {m.num_embeddings} not divisible by tensor degree {degree}")
            continue
        if kind == "col" and isinstance(m, nn.Embedding):  # a per-head table (T5's relative bias)
            if m.embedding_dim % degree:
                bad.append(f"{n}: {m.embedding_dim} columns not divisible by tensor degree {degree}")
            continue
        if not is_proj(m):
            bad.append(f"{n}: {type(m).__name__} is not an nn.Linear, Conv1D or a LoRA wrapper of one")
            continue
        in_f, out_f = proj_features(m)
        size = out_f if kind == "col" else in_f
        stride = int(kw.get("stride", 1))
        if size % (degree * stride):
            bad.append(
                f"{n}: {'output' if kind == 'col' else 'input'} features {size} "
                f"not divisible by degree {degree} x stride {stride}"
            )
    for n, attrs in shrink.items():
        for a in attrs:
            v = getattr(modules[n], a, None)
            if not isinstance(v, int):
                bad.append(f"{n}.{a}: no integer attribute to shrink")
            elif v % degree:
                bad.append(f"{n}.{a} = {v}: heads not divisible by tensor degree {degree}")
    return bad


def resolve(model: nn.Module, degree: int, entries, notes: list[str], sequence_parallel: bool) -> Placements:
    """The checked placements of ``entries`` on ``model``; TensorParallelPlanError on any failure."""
    modules = dict(model.named_modules())
    shard, shrink, drops, summed = _match(model, entries)
    bad = _uneven(modules, shard, shrink, degree)
    for n, kind in drops.items():
        if kind == "replic_drop" and sequence_parallel and not isinstance(modules[n], nn.Dropout):
            bad.append(
                f"{n}: replic_drop under sequence_parallel needs an nn.Dropout "
                "(it draws the full mask and keeps its sequence slice)"
            )
    if bad:
        raise TensorParallelPlanError("cannot split these layers evenly", bad)
    if degree > 1:
        notes = [*notes, verify(model, shard, shrink, degree)]
    return Placements(shard, shrink, drops, summed, list(notes))


def keep_failing_pairs(
    model: nn.Module, degree: int, auto: AutoPlan, error: TensorParallelPlanError, sequence_parallel: bool
) -> Placements:
    """The auto plan less the pairs that fail the check, each named in the notes with its reason.

    Pairs are added one pattern at a time in forward order and kept only if the plan with them still
    passes, so a failure that shows only beside another pair is pinned on the later one. ``error``
    (the whole plan's) is raised when no pair passes: then nothing shardable remains."""
    accepted: list = []
    kept: list[str] = []
    last = None
    for pair in auto.pairs:
        try:
            last = resolve(model, degree, [*accepted, *pair.entries], [], sequence_parallel)
        except TensorParallelPlanError as e:
            kept.append(f"kept whole (replicated), failing the check at one rank's shapes: {pair.label}: {e.problem}")
            own = [n for n in e.names if any(n == x or n.startswith((x + ":", x + ".")) for _, x, _ in pair.entries)]
            if own and set(own) != {x for k, x, _ in pair.entries if k in ("col", "row")}:  # which of its parts
                kept[-1] += f" ({', '.join(own[:2])}{' ...' if len(own) > 2 else ''})"
            continue
        accepted += pair.entries
    if last is None:
        raise error
    return last._replace(notes=[*auto.notes, *kept, *last.notes])


def _localize(m: nn.Module, kind: str, kw: dict, degree: int) -> None:
    """Give a replica module the shapes one rank holds under ``kind``."""
    if kind == "vocab" or kw.get("gather_output"):
        return  # the output is gathered: the shapes around it are the full ones
    base = lora.lora_base(m)
    if base is not None:  # a LoRA wrapper: its base layer and the adapter side that shards with it
        mods = dict(m.named_modules())
        for n, k in lora.parts("", m, kind):
            _localize(mods[n.lstrip(".")], k, kw, degree)
        return
    if isinstance(m, nn.Embedding):
        m.weight = nn.Parameter(m.weight.new_zeros(m.num_embeddings, m.embedding_dim // degree), requires_grad=False)
        m.embedding_dim //= degree
        return
    conv = is_conv1d(m)
    in_f, out_f = graph.features(m)
    if kind == "col":
        out_f //= degree
    else:
        in_f //= degree
    shape = (in_f, out_f) if conv else (out_f, in_f)
    m.weight = nn.Parameter(m.weight.new_zeros(shape), requires_grad=False)
    if m.bias is not None and kind == "col":
        m.bias = nn.Parameter(m.bias.new_zeros(out_f), requires_grad=False)
    if conv:
        m.nf = out_f
    else:
        m.in_features, m.out_features = in_f, out_f


def verify(model: nn.Module, shard: dict, shrink: dict, degree: int) -> str:
    """Run one rank's shapes (a zero-weight replica) on an example input; TensorParallelPlanError when
    the plan would fail mid-forward. Returns what was checked, for explain()."""
    example = graph.example_input(model)
    if example is None:
        return "plan not verified (no example input could be guessed for this model)"
    cols = [n for n, (kind, kw) in shard.items() if kind == "col" and not kw.get("gather_output")]
    cols = [n for n in cols if is_linear(dict(model.named_modules())[n])]  # LoRA wrappers: their output is a sum
    try:
        whole = graph.split_views(graph.replica(model), example, cols)
    except Exception as e:  # noqa: BLE001 - the model itself does not take the guessed input
        return f"plan not verified (the model does not run on a guessed example input: {type(e).__name__})"
    rep = graph.replica(model)
    modules = dict(rep.named_modules())
    for n, (kind, kw) in shard.items():
        _localize(modules[n], kind, kw, degree)
    for n, attrs in shrink.items():
        for a in attrs:
            setattr(modules[n], a, getattr(modules[n], a) // degree)
    try:
        local = graph.split_views(rep, example, cols)
    except Exception as e:  # noqa: BLE001 - any failure of the sharded shapes is the plan's fault
        raise TensorParallelPlanError(
            f"at tensor degree {degree} one rank's shapes fail a forward on an example input "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})",
            sorted(shard),
            MANUAL_FORM,
        ) from None
    fixed = graph.fixed_head_reads(whole, local)
    if fixed:
        raise TensorParallelPlanError(
            f"at tensor degree {degree} a rank's shard of these projections is split into smaller heads, not "
            "fewer (the forward views it with a head count fixed at init, e.g. .view(b, t, 3, self.heads, -1)): "
            "the shapes fit but it would compute another model",
            fixed,
            "a plan keeping them whole, or read the heads from the width (.view(b, t, 3, -1, head_dim))",
        )
    return f"plan verified at tensor degree {degree}: one rank's shapes run a forward on an example input"

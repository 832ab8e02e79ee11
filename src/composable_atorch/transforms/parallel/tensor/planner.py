"""What tensor parallelism shards: ATorch's :class:`TPInfo`, plan normalisation and the auto planner.

Pure functions of a model's module tree (nothing is sharded here); :mod:`.tensor` applies a plan
with DTensor's ``parallelize_module``. See :mod:`.tensor` for the three plan forms.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from torch import nn

from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.tensor import graph, lora
from composable_atorch.transforms.parallel.tensor.graph import is_conv1d, is_linear, is_proj  # noqa: F401

KINDS = ("col", "row", "vocab", "replic_drop", "parallel_drop", "shrink", "grad_sum")
_HF_KINDS = {
    "colwise": "col",
    "rowwise": "row",
    "colwise_rep": "col",
    "rowwise_rep": "row",
    "vocab": "vocab",
    "embedding": "vocab",
}


class TensorParallelPlanError(ConfigError):
    """The planner could not place layers, or a layer cannot be split as asked."""

    def __init__(self, problem: str, names, manual: str = ""):
        self.problem, self.names = problem, list(names)
        shown = ", ".join(self.names[:10]) + (" ..." if len(self.names) > 10 else "")
        hint = f" Pass a manual plan, e.g. {manual}" if manual else ""
        super().__init__("tensor_parallel.plan", shown, f"{problem}.{hint}")


MANUAL_FORM = (
    "tensor_parallel(TPInfo().shard_col({'attn.c_attn': {'stride': 3}}, 'mlp.c_fc').shard_row('attn.c_proj', "
    "'mlp.c_proj')"
    ".shrink({'.attn': {'embed_dim', 'split_size', 'num_heads'}}))"
)


class TPInfo:
    """ATorch's manual tensor-parallel description; every method returns ``self`` (chainable).

    Arguments are module-name suffixes (``"mlp.c_fc"``, ``fnmatch`` wildcards allowed) or
    ``{suffix: {init kwargs}}``; the one kwarg read is ``stride`` (a fused projection such as
    GPT-2's qkv ``c_attn``: each rank keeps its slice of each of the ``stride`` parts).
    """

    def __init__(self):
        self.entries: list[tuple[str, str, tuple]] = []

    def _add(self, kind, specs, values_are_attrs=False):
        for spec in specs:
            items = spec.items() if isinstance(spec, dict) else [(spec, {})]
            for suffix, kw in items:
                if not isinstance(suffix, str) or not suffix:
                    raise ConfigError(f"TPInfo.{kind} suffix", suffix, "a module-name suffix such as 'mlp.c_fc'")
                if values_are_attrs:
                    value = tuple(sorted(kw))
                else:
                    if not isinstance(kw, dict):
                        raise ConfigError(
                            f"TPInfo.{kind}[{suffix!r}]", kw, "a dict of init kwargs such as {'stride': 3}"
                        )
                    value = tuple(sorted(kw.items()))
                self.entries.append((kind, suffix, value))
        return self

    def shard_col(self, *specs):
        return self._add("col", specs)

    def shard_row(self, *specs):
        return self._add("row", specs)

    def shard_vocab(self, *specs):
        return self._add("vocab", specs)

    def replic_drop(self, *specs):
        return self._add("replic_drop", specs)

    def parallel_drop(self, *specs):
        return self._add("parallel_drop", specs)

    def shrink(self, *specs):
        """``{".attn": {"embed_dim", "num_heads"}}``: these attributes are divided by the degree."""
        return self._add("shrink", specs, values_are_attrs=True)

    @property
    def is_vocab_parallelled(self) -> bool:
        return any(k == "vocab" for k, _, _ in self.entries)


def normalize_plan(plan: Any):
    """``"auto"``, or a sorted tuple of ``(kind, suffix, args)`` entries (data: hashable, JSON-able)."""
    if plan == "auto":
        return "auto"
    if isinstance(plan, TPInfo):
        entries = plan.entries
    elif isinstance(plan, dict):
        entries = []
        for pattern, style in plan.items():
            kind = _HF_KINDS.get(style, style if style in KINDS else None)
            if kind is None:
                raise ConfigError(f"tensor_parallel.plan[{pattern!r}]", style, f"one of {sorted(_HF_KINDS)} or {KINDS}")
            entries.append((kind, pattern, ()))
    elif isinstance(plan, tuple | list):
        entries = []
        for e in plan:
            if not (isinstance(e, tuple | list) and len(e) == 3 and e[0] in KINDS and isinstance(e[1], str)):
                raise ConfigError("tensor_parallel.plan entry", e, f"(kind, suffix, args) with kind in {KINDS}")
            entries.append((e[0], e[1], tuple(tuple(x) if isinstance(x, list) else x for x in e[2])))
    else:
        raise ConfigError(
            "tensor_parallel.plan", plan, "'auto', a TPInfo, or a mapping {'blocks.*.attn.q': 'colwise', ...}"
        )
    if not entries:
        raise ConfigError("tensor_parallel.plan", plan, "at least one layer to shard")
    return tuple(sorted(entries))


def name_matches(qualname: str, pattern: str) -> bool:
    p = pattern.lstrip(".")
    return fnmatch.fnmatchcase(qualname, p) or fnmatch.fnmatchcase(qualname, "*." + p)


# ---------------------------------------------------------------------------------------------
# the auto planner
# ---------------------------------------------------------------------------------------------

#: transformers' per-layer styles this transform applies as shipped; a plan with any other style
#: (Phi-3's ``colwise_gather_output`` on fused projections, Mixtral's ``packed_colwise`` experts)
#: is planned by the generic planner instead.
_HF_PLAIN = {"colwise", "rowwise", "replicated_with_grad_allreduce", "embedding_rowwise"}

#: transformers' model-level styles (``model.tp_plan``) as this planner's entries. Its
#: ``embedding_rowwise`` is left out of the auto plan: torch's DTensor gives a vocabulary-sharded
#: embedding a *replicated* gradient (measured: Replicate() grad on a Shard(0) weight), so on every
#: tensor rank the whole gradient exists each step and the saving is smaller than it looks;
#: ``TPInfo().shard_vocab(...)`` still shards it when asked.
_HF_MODEL_STYLES = {"colwise_gather_output": ("col", (("gather_output", True),))}


def _hf_model_level(model: nn.Module, base: dict) -> list[tuple[str, str, tuple]]:
    """The entries of transformers' whole-model plan beyond the base model's (Llama: ``lm_head``
    colwise with gathered logits), used as shipped.

    A head tied to the embedding is left to the base plan: one weight cannot be both a vocab-row
    and a column shard (tensor_parallel shards a tied head with its embedding instead)."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict) or getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return []
    out = []
    for pattern, style in plan.items():
        if style in _HF_MODEL_STYLES and not any(pattern.endswith(p) for p in base):
            kind, args = _HF_MODEL_STYLES[style]
            out.append((kind, pattern, args))
    return out


def _hf_entries(model: nn.Module, generic: list, notes: list[str]) -> list | None:
    """transformers' ``base_model_tp_plan`` as entries when it is plain colwise/rowwise and places the
    same layers as the traced pairs (so head counts and summed gradients are known); None otherwise."""
    hf = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not hf:
        return None
    odd = sorted({s for s in hf.values() if s not in _HF_PLAIN})
    if odd:
        notes.append(f"transformers' base_model_tp_plan uses {', '.join(odd)}: planned from the module graph instead")
        return None
    entries = [(_HF_KINDS[s], p, ()) for p, s in hf.items() if s in ("colwise", "rowwise")]
    names = [n for n, _ in model.named_modules() if n]
    hf_set = {(k, n) for k, p, _ in entries for n in names if name_matches(n, p)}
    mine = {(k, n) for k, n, a in generic if k in ("col", "row") and not dict(a).get("gather_output")}
    if hf_set != mine:
        notes.append("transformers' base_model_tp_plan differs from the traced pairs: the traced pairs are used")
        return None
    keep = [e for e in generic if e[0] not in ("col", "row") or dict(e[2]).get("gather_output")]
    return entries + keep + _hf_model_level(model, hf)


def _by_name(model: nn.Module) -> list[tuple[tuple[str, ...], str, list]]:
    """Sibling projections with the usual names, for a model whose forward cannot be traced on an
    example input (the generic planner's fallback): ``(columns, row, entries)`` per pair."""
    groups = (
        (("q", "k", "v"), "o"),
        (("q_proj", "k_proj", "v_proj"), "o_proj"),
        (("fc1",), "fc2"),
        (("gate_proj", "up_proj"), "down_proj"),
        (("c_fc",), "c_proj"),
        (("w1", "w3"), "w2"),
    )
    found = []
    for name, m in model.named_modules():
        children = dict(m.named_children())
        for cols, row in groups:
            if row in children and all(c in children for c in cols):
                if not all(is_proj(children[c]) for c in (*cols, row)):
                    continue
                names = tuple(f"{name}.{c}" if name else c for c in cols)
                rname = f"{name}.{row}" if name else row
                entries = [("col", c, ()) for c in names] + [("row", rname, ())]
                heads = tuple(sorted(graph.heads_of(m)))
                if heads:
                    entries.append(("shrink", name, heads))
                found.append((names, rname, entries))
    return found


def _placed(found: list) -> int:
    return sum(len(p.cols) + 1 for p in found)


@dataclass(frozen=True)
class PairPlan:
    """One pair's entries (columns, row, and the head counts, per-head tables and summed norms that go
    with them), merged with the same pair of the other blocks under one pattern (``layers.*.mlp.{gate_proj,
    up_proj -> down_proj}``): what the check at one rank's shapes keeps whole together when it fails."""

    label: str
    entries: tuple[tuple[str, str, tuple], ...]


@dataclass(frozen=True)
class AutoPlan:
    """The auto plan: ``entries`` as applied when every pair passes the check (transformers' own
    ``base_model_tp_plan`` where it places the same layers), the traced ``pairs`` it was made of (in
    forward order) and what explain() should say about it (``source``: only when ``entries`` is used)."""

    entries: tuple
    pairs: tuple[PairPlan, ...]
    notes: tuple[str, ...]
    source: tuple[str, ...] = ()


def pair_label(cols, row: str) -> str:
    """``layers.*.self_attn.{q_proj, k_proj, v_proj -> o_proj}``: the names' common module path, block
    indices as ``*``, then the projections' own names."""
    parts = [n.split(".") for n in (*cols, row)]
    k = 0
    while k < min(len(p) for p in parts) - 1 and len({p[k] for p in parts}) == 1:
        k += 1
    head = ".".join("*" if s.isdigit() else s for s in parts[0][:k])
    rest = [".".join(p[k:]) for p in parts]
    return f"{head + '.' if head else ''}{{{', '.join(rest[:-1])} -> {rest[-1]}}}"


def _grouped(found: list[tuple[tuple[str, ...], str, list]]) -> tuple[PairPlan, ...]:
    merged: dict[str, list] = {}
    for cols, row, entries in found:
        merged.setdefault(pair_label(cols, row), []).extend(entries)
    return tuple(PairPlan(label, tuple(e)) for label, e in merged.items())


def plan_with_notes(model: nn.Module) -> tuple[tuple, list[str]]:
    """The auto plan for ``model`` and what explain() should say about it (see :mod:`.graph`)."""
    auto = plan_auto(model)
    return auto.entries, [*auto.notes, *auto.source]


def plan_auto(model: nn.Module) -> AutoPlan:
    """The auto plan with its pairs (:class:`AutoPlan`); TensorParallelPlanError when there is no pair."""
    notes: list[str] = []
    example = graph.example_input(model)
    tr = None
    if example is not None:
        try:
            tr = graph.trace(model, example)
        except Exception as e:  # noqa: BLE001 - a model that cannot run the guessed input falls back to names
            notes.append(f"forward on an example input failed ({type(e).__name__}): planned by layer names")
    found: list[tuple[tuple[str, ...], str, list]] = []
    source: list[str] = []
    if tr is not None:
        # blocks write back to a residual stream; a plain chain (ATorch's toy models) has none:
        # whichever reading places more layers is the model's
        traced = max(graph.pairs(model, tr), graph.pairs(model, tr, residual=False), key=_placed)
        sharded: set[str] = set()
        for p in traced:
            p = graph.fused_stride(model, p)
            if p.reason:
                notes.append(f"kept whole (replicated): {p.reason}")
                continue
            args = (("stride", p.stride),) if p.stride > 1 else ()
            ents = [("col", c, args) for c in p.cols] + [("row", p.row, ())]
            ents += [("shrink", n, a) for n, a in graph.shrink_attrs(model, p).items()]
            emb = graph.head_embeddings(model, p)
            ents += [("col", e, ()) for e in emb]
            sharded.update((*p.cols, p.row, *emb))
            ents += [("grad_sum", n, ()) for n in graph.partial_grad_modules(tr, p, sharded)]
            found.append((p.cols, p.row, ents))
    else:
        found = _by_name(model)
    generic = [e for _, _, ents in found for e in ents]
    pairs = _grouped(found)
    entries = generic
    if tr is not None:
        hf = _hf_entries(model, generic, notes)
        if hf is not None:
            entries, source = hf, ["layers placed by transformers' base_model_tp_plan"]
        head = _hf_model_level(model, getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})
        if head:  # transformers' logits head, column-sharded and gathered: checked on its own too
            pairs = (*pairs, PairPlan(f"{head[0][1]} (column, logits gathered)", tuple(head)))
    if any(type(m).__name__.endswith(("Experts", "SparseMoeBlock", "MoE")) for m in model.modules()):
        notes.append(
            "mixture-of-experts layers kept whole: every tensor rank holds every expert "
            "(expert parallelism is not done here)"
        )
    variants = [n for n, m in model.named_modules() if lora.is_wrapper(m) and lora.lora_base(m) is None]
    if variants:
        notes.append(
            f"{len(variants)} peft adapter layer(s) of a variant (DoRA's weight norm reads the whole weight) or "
            f"merged are not split: kept whole with what they feed ({variants[0]} ...)"
        )
    if not any(k in ("col", "row") for k, _, _ in entries):
        linears = [n for n, m in model.named_modules() if is_proj(m)]
        raise TensorParallelPlanError(
            "the auto planner found no column-then-row projection pair"
            + (f" ({'; '.join(notes)})" if notes else "")
            + f" and could not place these {len(linears)} Linear layer(s)",
            linears or ["(no Linear layers)"],
            MANUAL_FORM,
        )
    notes += _whole_note(model, entries)
    return AutoPlan(tuple(sorted(set(entries))), pairs, tuple(notes), tuple(source))


def _whole_note(model: nn.Module, entries) -> list[str]:
    """Which projections the plan leaves whole (replicated), grouped by block pattern (``layers.*.attn``),
    so explain() says what is not sharded (latent attention's low-rank projections, heads, routers)."""
    names = [n for n, m in model.named_modules() if n and is_proj(m)]
    inside = {n for n, m in model.named_modules() if lora.is_wrapper(m)}
    placed = {n for k, p, _ in entries if k in ("col", "row", "vocab") for n in names if name_matches(n, p)}
    groups: dict[str, list[str]] = {}
    for n in names:
        if n in placed or any(n.startswith(w + ".") for w in inside):
            continue
        parent, _, leaf = n.rpartition(".")
        key = ".".join("*" if part.isdigit() else part for part in parent.split("."))
        if leaf not in groups.setdefault(key, []):
            groups[key].append(leaf)
    if not groups:
        return []
    shown = "; ".join(f"{k + '.' if k else ''}{{{', '.join(v)}}}" for k, v in list(groups.items())[:6])
    more = " ..." if len(groups) > 6 else ""
    return [f"kept whole (replicated), in no column -> row pair: {shown}{more}"]


def auto_plan(model: nn.Module) -> tuple:
    """The plan for ``model``, or TensorParallelPlanError naming the Linear layers it could not place."""
    return plan_with_notes(model)[0]

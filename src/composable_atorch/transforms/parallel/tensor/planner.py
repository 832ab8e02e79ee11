"""What tensor parallelism shards: ATorch's :class:`TPInfo`, plan normalisation and the auto planner.

Pure functions of a model's module tree (nothing is sharded here); :mod:`.tensor` applies a plan
with DTensor's ``parallelize_module``. See :mod:`.tensor` for the three plan forms.
"""

from __future__ import annotations

import fnmatch
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
    notes.append("layers placed by transformers' base_model_tp_plan")
    keep = [e for e in generic if e[0] not in ("col", "row") or dict(e[2]).get("gather_output")]
    return entries + keep + _hf_model_level(model, hf)


def _by_name(model: nn.Module) -> list[tuple[str, str, tuple]]:
    """Sibling projections with the usual names, for a model whose forward cannot be traced on an
    example input (the generic planner's fallback)."""
    groups = (
        (("q", "k", "v"), "o"),
        (("q_proj", "k_proj", "v_proj"), "o_proj"),
        (("fc1",), "fc2"),
        (("gate_proj", "up_proj"), "down_proj"),
        (("c_fc",), "c_proj"),
        (("w1", "w3"), "w2"),
    )
    entries: list[tuple[str, str, tuple]] = []
    for name, m in model.named_modules():
        children = dict(m.named_children())
        for cols, row in groups:
            if row in children and all(c in children for c in cols):
                if not all(is_proj(children[c]) for c in (*cols, row)):
                    continue
                entries += [("col", f"{name}.{c}" if name else c, ()) for c in cols]
                entries.append(("row", f"{name}.{row}" if name else row, ()))
                heads = tuple(sorted(graph.heads_of(m)))
                if heads:
                    entries.append(("shrink", name, heads))
    return entries


def _placed(found: list) -> int:
    return sum(len(p.cols) + 1 for p in found)


def plan_with_notes(model: nn.Module, attention: bool = True) -> tuple[tuple, list[str]]:
    """The auto plan for ``model`` and what explain() should say about it (see :mod:`.graph`).

    ``attention=False`` keeps attention-like pairs whole (head counts on the module, or several or
    fused projections feeding one): the MLPs alone shard."""
    notes: list[str] = []
    example = graph.example_input(model)
    tr = None
    if example is not None:
        try:
            tr = graph.trace(model, example)
        except Exception as e:  # noqa: BLE001 - a model that cannot run the guessed input falls back to names
            notes.append(f"forward on an example input failed ({type(e).__name__}): planned by layer names")
    entries: list[tuple[str, str, tuple]] = []
    if tr is not None:
        # blocks write back to a residual stream; a plain chain (ATorch's toy models) has none:
        # whichever reading places more layers is the model's
        found = max(graph.pairs(model, tr), graph.pairs(model, tr, residual=False), key=_placed)
        sharded: set[str] = set()
        for p in found:
            p = graph.fused_stride(model, p)
            heads = graph.shrink_attrs(model, p)
            if not attention and (heads or len(p.cols) > 1 or p.stride > 1 or p.reason):
                continue  # attention-like: several or fused projections into one
            if p.reason:
                notes.append(f"kept whole (replicated): {p.reason}")
                continue
            args = (("stride", p.stride),) if p.stride > 1 else ()
            entries += [("col", c, args) for c in p.cols]
            entries.append(("row", p.row, ()))
            entries += [("shrink", n, a) for n, a in heads.items()]
            emb = graph.head_embeddings(model, p)
            entries += [("col", e, ()) for e in emb]
            sharded.update((*p.cols, p.row, *emb))
            entries += [("grad_sum", n, ()) for n in graph.partial_grad_modules(tr, p, sharded)]
        entries = _hf_entries(model, entries, notes) or entries
    else:
        entries = _by_name(model)
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
    return tuple(sorted(set(entries))), notes


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


# ---------------------------------------------------------------------------------------------
# verification before any weight moves
# ---------------------------------------------------------------------------------------------


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

"""What tensor parallelism shards: ATorch's :class:`TPInfo`, plan normalisation and the auto planner.

Pure functions of a model's module tree (nothing is sharded here); :mod:`.tensor` applies a plan
with DTensor's ``parallelize_module``. See :mod:`.tensor` for the three plan forms.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from composable_atorch.errors import ConfigError

KINDS = ("col", "row", "vocab", "replic_drop", "parallel_drop", "shrink")
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

#: (column-parallel names, row-parallel name) of the projection groups the planner knows.
_GROUPS = (
    (("q", "k", "v"), "o"),
    (("q_proj", "k_proj", "v_proj"), "o_proj"),
    (("fc1",), "fc2"),
    (("gate_proj", "up_proj"), "down_proj"),
    (("c_fc",), "c_proj"),
    (("w1", "w3"), "w2"),
)
#: head-count attributes divided by the degree when present on an attention module
_HEAD_ATTRS = ("n_head", "num_heads", "num_key_value_heads", "n_kv_head")


def is_linear(m) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def is_conv1d(m) -> bool:
    return (
        type(m).__name__ == "Conv1D"
        and hasattr(m, "nf")
        and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2
    )


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


def auto_plan(model: nn.Module) -> tuple:
    """The plan for ``model``, or TensorParallelPlanError naming the Linear layers it could not place."""
    entries: list[tuple[str, str, tuple]] = []
    hf = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if hf:
        for pattern, style in hf.items():
            kind = _HF_KINDS.get(style)
            if kind in ("col", "row"):
                entries.append((kind, pattern, ()))
        entries.extend(_hf_model_level(model, hf))
        for name, m in model.named_modules():
            if any(hasattr(m, a) for a in _HEAD_ATTRS) and any(isinstance(c, nn.Linear) for c in m.children()):
                entries.append(("shrink", name, tuple(a for a in _HEAD_ATTRS if hasattr(m, a))))
        return tuple(sorted(entries))
    placed: set[str] = set()
    for name, m in model.named_modules():
        children = dict(m.named_children())
        for cols, row in _GROUPS:
            if (
                row in children
                and all(c in children for c in cols)
                and all(isinstance(children[c], nn.Linear) for c in (*cols, row))
            ):
                for c in cols:
                    entries.append(("col", f"{name}.{c}" if name else c, ()))
                entries.append(("row", f"{name}.{row}" if name else row, ()))
                placed.update(f"{name}.{c}" if name else c for c in (*cols, row))
                heads = tuple(a for a in _HEAD_ATTRS if hasattr(m, a))
                if heads:
                    entries.append(("shrink", name, heads))
    if not placed:
        linears = [n for n, m in model.named_modules() if is_linear(m)]
        raise TensorParallelPlanError(
            "the auto planner found no projection pair it knows "
            f"({', '.join('/'.join(c) + '+' + r for c, r in _GROUPS)}) "
            f"and could not place these {len(linears)} Linear layer(s)",
            linears or ["(no Linear layers)"],
            MANUAL_FORM,
        )
    return tuple(sorted(entries))

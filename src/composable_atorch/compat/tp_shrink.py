"""ATorch's ``TPInfo.shrink`` entries, written for transformers 4, read against the model they are given.

ATorch's scripts shrink attention attributes (``num_heads``, ``num_key_value_heads``, ``hidden_size``)
because transformers 4's attention reshaped its projections with them. transformers 5's attention
modules no longer have them: they reshape by ``head_dim`` with ``-1`` heads, so a projection sharded
over the tensor ranks gives each rank its heads by itself and there is nothing to shrink. The
facade drops such an attribute before the plan is built, and only when none of the modules the
entry names has it and they are all transformers' own classes; ``explain()`` says what was dropped
and why. Any other missing attribute (a user's module) stays the planner's typed error.
"""

from __future__ import annotations

import copy

from torch import nn

from composable_atorch.transforms.parallel.tensor.planner import TPInfo, name_matches


def _from_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _resolve(model: nn.Module, info: TPInfo, notes: list[str]) -> TPInfo:
    modules = [(n, m) for n, m in model.named_modules() if n]
    kept, changed = [], False
    for kind, pattern, attrs in info.entries:
        hits = [m for n, m in modules if name_matches(n, pattern)]
        if kind != "shrink" or not hits or not all(_from_transformers(m) for m in hits):
            kept.append((kind, pattern, attrs))
            continue
        absent = tuple(a for a in attrs if not any(hasattr(m, a) for m in hits))
        if not absent:
            kept.append((kind, pattern, attrs))
            continue
        changed = True
        rest = tuple(a for a in attrs if a not in absent)
        if rest:
            kept.append((kind, pattern, rest))
        classes = sorted({type(m).__name__ for m in hits})
        notes.append(
            f"TPInfo.shrink {pattern!r} {list(absent)}: dropped: transformers' {', '.join(classes)} has no such "
            "attribute (it reshapes by head_dim, so the sharded projections carry each rank's heads: nothing to "
            "shrink; ATorch's TPInfo was written for transformers 4)"
        )
    if not changed:
        return info
    out = copy.copy(info)
    out.entries = kept
    return out


def _resolve_config(model: nn.Module, config, notes: list[str]):
    if isinstance(config, TPInfo):
        return _resolve(model, config, notes)
    if isinstance(config, dict):
        new = {k: _resolve(model, v, notes) if isinstance(v, TPInfo) else v for k, v in config.items()}
        return new if any(new[k] is not config[k] for k in config) else config
    info = getattr(config, "tpinfo", None)
    if isinstance(info, TPInfo):
        resolved = _resolve(model, info, notes)
        if resolved is not info:
            config = copy.copy(config)  # the caller's config is left as it was
            config.tpinfo = resolved
    return config


def resolve_shrinks(model: nn.Module, load_strategy) -> tuple[object, tuple[str, ...]]:
    """``(load_strategy, notes)``: a list strategy with the shrinks transformers 5 made moot dropped
    from its TPInfo configs (see the module doc); any other strategy form is returned as it is."""
    if not isinstance(load_strategy, list | tuple) or not isinstance(model, nn.Module):
        return load_strategy, ()
    notes: list[str] = []
    out = []
    for entry in load_strategy:
        if isinstance(entry, tuple | list) and len(entry) >= 2:
            entry = type(entry)([entry[0], _resolve_config(model, entry[1], notes), *entry[2:]])
        out.append(entry)
    if not notes:
        return load_strategy, ()
    return type(load_strategy)(out), tuple(dict.fromkeys(notes))

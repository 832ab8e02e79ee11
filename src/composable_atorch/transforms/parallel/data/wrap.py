"""What ``fully_shard`` wraps: block targets, FSDP1-style wrap policies walked as FSDP1 walks them,
and ATorch's FSDP1 options read as FSDP2's (mapped, accepted as moot, or refused with the reason).

Pure functions of the module tree and the options: nothing is sharded here (:mod:`.sharding` does).
"""

from __future__ import annotations

from torch import nn

from composable_atorch.errors import ConfigError
from composable_atorch.transforms._util import is_block_target, matches

#: ATorch's FSDP1 options that FSDP2 makes moot (always original params, rate-limited all-gathers,
#: module states synced here before sharding). Accepted from ATorch configs and shown in explain().
FSDP1_OPTIONS = ("forward_prefetch", "limit_all_gathers", "sync_module_states", "use_orig_params", "backward_prefetch")


#: FSDP1 arguments ATorch forwards that have no FSDP2 meaning: refused, each with why.
FSDP1_REFUSED = {
    "mixed_precision": "FSDP1's MixedPrecision is amp / half here: add amp('bf16') (FSDP2 all-gathers in its dtype) or "
    "half('bf16')",
    "param_init_fn": "FSDP2 has no param_init_fn: materialize the model (e.g. from the meta device) before applying "
    "the plan",
    "ignored_states": "pass atorch_ignored_cls (module classes) instead: parameters are not known when the plan is "
    "built",
    "ignored_modules": "pass atorch_ignored_cls (module classes or names) instead of module instances",
    "process_group": "parallel_mode makes the process groups and the device mesh fsdp shards over",
    "device_mesh": "parallel_mode makes the process groups and the device mesh fsdp shards over",
    "device_id": "FSDP2 shards on the device mesh's device; move the model there before the plan",
    "intra_load": "ATorch's meta-model loader is not supported: load weights before applying the plan",
    "parse_fsdp": "ATorch's ParseFSDP debugging wrapper is not supported",
    "parse_cb": "ATorch's ParseFSDP debugging wrapper is not supported",
}


def from_auto_wrap_policy(policy) -> dict:
    """FSDP1's ``auto_wrap_policy`` as fsdp fields: transformer (classes) or size-based (min params)."""
    import functools

    cls_set = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
    if cls_set is not None:
        return {"wrap": tuple(cls_set)}
    if isinstance(policy, functools.partial):
        kw = policy.keywords or {}
        if "transformer_layer_cls" in kw:
            return {"wrap": tuple(kw["transformer_layer_cls"])}
        if "module_classes" in kw:
            return {"wrap": tuple(kw["module_classes"])}
        if "min_num_params" in kw:
            return {"min_params": int(kw["min_num_params"])}
    if callable(policy):  # any FSDP1-style policy(module, recurse, nonwrapped_numel): evaluated over the modules
        return {"wrap_policy": policy}
    raise ConfigError(
        "fsdp auto_wrap_policy",
        policy,
        "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={...}), ModuleWrapPolicy({...}) or "
        "functools.partial(size_based_auto_wrap_policy, min_num_params=n), or any callable "
        "policy(module, recurse, nonwrapped_numel)",
    )


def from_sharding_strategy(value) -> tuple[bool, bool]:
    """FSDP1's ShardingStrategy as ``(reshard_after_forward, hybrid)``.

    HYBRID_SHARD / _HYBRID_SHARD_ZERO2 are hybrid sharding: over parallel_mode's 'zero' dimension
    when it has one, else inside each node and replicated across nodes (FSDP1's own default)."""
    name = getattr(value, "name", value)
    known = {
        "FULL_SHARD": (True, False),
        "SHARD_GRAD_OP": (False, False),
        "HYBRID_SHARD": (True, True),
        "_HYBRID_SHARD_ZERO2": (False, True),
    }
    if name in known:
        return known[name]
    why = {"NO_SHARD": "use ddp() for unsharded data parallelism"}
    raise ConfigError(
        "fsdp sharding_strategy",
        value,
        f"FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or _HYBRID_SHARD_ZERO2 "
        f"({why.get(name, 'FSDP1 strategies map onto reshard_after_forward and hybrid sharding')})",
    )


def block_targets(value, field: str) -> tuple:
    if isinstance(value, type | str):
        value = (value,)
    value = tuple(value or ())
    bad = [t for t in value if not is_block_target(t)]
    if bad:
        raise ConfigError(field, bad[0], "nn.Module subclasses, class names or qualified module names")
    return value


def target_name(t) -> str:
    return t.__name__ if isinstance(t, type) else t


def _policy_reachable(model: nn.Module, policy) -> set[int]:
    """FSDP1's walk: a module is considered (for wrapping, and its children at all) only where
    ``policy(module, recurse=True, ...)`` holds for it and every ancestor (the root always descends)."""
    reachable = {id(model)}
    modules = dict(model.named_modules())
    for qualname, module in modules.items():  # parents before children
        if module is model:
            continue
        parent = modules[qualname.rpartition(".")[0]]
        numel = sum(p.numel() for p in module.parameters())
        if id(parent) in reachable and policy(module=module, recurse=True, nonwrapped_numel=numel):
            reachable.add(id(module))
    return reachable


def wrap_targets(
    model: nn.Module, wrap: tuple, min_params: int, ignored: set, trainable_outmost: bool, policy=None
) -> list[nn.Module]:
    """Modules to shard as their own group, children before parents (FSDP2 needs that order).

    ``policy``: an FSDP1-style ``auto_wrap_policy(module, recurse, nonwrapped_numel)``, evaluated as
    FSDP1 does (descend where ``recurse=True`` says so, wrap where ``recurse=False`` does, counting
    only parameters no chosen descendant holds) so that FSDP2 shards the same modules."""
    reachable = _policy_reachable(model, policy) if policy is not None else None
    ignored_ids = {id(m) for m in ignored}
    inside_ignored: set[int] = set()
    for m in ignored:
        inside_ignored.update(id(s) for s in m.modules())
    chosen: list[nn.Module] = []
    managed: set[int] = set()  # params already in a chosen descendant
    for qualname, module in reversed(list(model.named_modules())):
        if module is model or id(module) in inside_ignored:
            continue
        if policy is not None:
            fresh = sum(p.numel() for p in module.parameters() if id(p) not in managed)
            take = id(module) in reachable and bool(policy(module=module, recurse=False, nonwrapped_numel=fresh))
        elif wrap:
            take = matches(module, qualname, wrap)
        elif min_params:
            fresh = sum(p.numel() for p in module.parameters() if id(p) not in managed)
            take = fresh >= min_params
        else:
            take = False
        if take:
            chosen.append(module)
            managed.update(id(p) for p in module.parameters())
    if trainable_outmost:
        # keep trainable parameters for the root group: a chosen module holding any is replaced by
        # its largest all-frozen submodules (LoRA: the frozen base layers shard per block).
        frozen: list[nn.Module] = []
        for m in chosen:
            if all(not p.requires_grad for p in m.parameters()):
                frozen.append(m)
                continue
            for sub in m.modules():
                params = list(sub.parameters())
                if params and all(not p.requires_grad for p in params) and not any(sub in f.modules() for f in frozen):
                    frozen.append(sub)
        chosen = [m for m in frozen if id(m) not in ignored_ids]
        # children before parents again
        chosen.sort(key=lambda m: -sum(1 for _ in m.modules()))
        chosen.reverse()
    return chosen

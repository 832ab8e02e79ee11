"""Memory: activation checkpointing of chosen blocks, keeping parameter names.

torch's ``checkpoint_wrapper`` renames parameters (``._checkpoint_wrapped_module.``), which would
break optimizer rebinding and saved state dicts; the composable
``torch.distributed._composable.checkpoint`` works in place and keeps names, so it is the default.
The reentrant variant (for models with ``@torch.jit.script`` parts, as ATorch notes) wraps the
block's forward in place, which also keeps names. How each runs (and what keeps a Hugging Face
key/value cache consistent under the recompute) is :mod:`composable_atorch.transforms.memory.recompute`.

``policy="selective"`` keeps the outputs of the expensive ops (matmuls, attention, reduce-scatter;
see :mod:`composable_atorch.transforms.memory.recompute`) and recomputes only the rest: torch's
``create_selective_checkpoint_contexts`` passed as the composable checkpoint's ``context_fn``
(names kept). More memory than ``"full"``, much less than none, and a cheaper backward.

ATorch's checkpoint config keys: ``wrap_class``, ``no_reentrant`` (default non-reentrant, as ATorch
documents), ``max_checkpoint_module_num`` (only the first N matching modules),
``selective_offload`` (validated as ATorch does, no effect on a CPU: it moves saved activations
from GPU memory to host memory, where they already are) and ``use_te_impl`` (no effect here:
transformer-engine's checkpoint needs a CUDA GPU and its package).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.transforms._util import is_block_target, outermost_matches
from composable_atorch.transforms.memory.recompute import (
    cache_guard,
    checkpoint_first,
    describe_saved,
    selective_contexts,
    takes_cache,
    wrap_reentrant,
)


def _target_name(t) -> str:
    return t.__name__ if isinstance(t, type) else t


@dataclass(frozen=True)
class Checkpoint(Transform):
    """Recompute the activations of each matching block in the backward pass instead of storing them."""

    name = "checkpoint"
    contract = Contract(stage=Stage.CHECKPOINT, roles=("activation_checkpoint",))

    targets: tuple = ()
    reentrant: bool = False
    #: ATorch's ``max_checkpoint_module_num``: checkpoint only the first N matching modules (None: all).
    max_modules: int | None = None
    #: ATorch keys accepted with no effect on this machine kind (named in explain()).
    inert: tuple[str, ...] = ()
    #: "full": keep only each block's inputs; "selective": also keep the expensive ops' outputs
    policy: str = "full"

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, type | str):
            targets = (targets,)
        targets = tuple(targets)
        if not targets:
            raise ConfigError("checkpoint targets", targets, "at least one block class, class name or module name")
        bad = [t for t in targets if not is_block_target(t)]
        if bad:
            raise ConfigError(
                "checkpoint target", bad[0], "an nn.Module subclass, a class name or a module's qualified name"
            )
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "reentrant", bool(self.reentrant))
        if self.max_modules is not None and (
            isinstance(self.max_modules, bool) or not isinstance(self.max_modules, int) or self.max_modules < 0
        ):
            raise ConfigError(
                "checkpoint.max_modules (max_checkpoint_module_num)",
                self.max_modules,
                "None (every matching module) or an integer >= 0",
            )
        inert = tuple(sorted(set(self.inert)))
        bad = [k for k in inert if k not in INERT_KEYS]
        if bad:
            raise ConfigError("checkpoint.inert", bad[0], f"one of {sorted(INERT_KEYS)}")
        object.__setattr__(self, "inert", inert)
        if self.policy not in POLICIES:
            raise ConfigError("checkpoint.policy", self.policy, " or ".join(repr(p) for p in POLICIES))
        if self.policy == "selective" and self.reentrant:
            raise ConfigError(
                "checkpoint.reentrant",
                True,
                "False with policy='selective' (torch's selective checkpointing runs on the non-reentrant checkpoint)",
            )

    @classmethod
    def candidates(cls, search):
        """Each repeated block class checkpointed fully; the outermost (the transformer layer, where
        torchtitan applies it) also selectively: inside a sub-block it saves nearly everything."""
        full = tuple(cls(targets=(b,)) for b in search.block_classes)
        return full + tuple(cls(targets=(b,), policy="selective") for b in search.block_classes[:1])

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's config: a tuple of classes/names, or ``{"wrap_class": ..., "no_reentrant": ...}``."""
        if config is None:
            raise ConfigError("checkpoint config", None, "the block classes or names to checkpoint, e.g. (Block,)")
        return checkpoint(config)

    def describe(self):
        kind = "reentrant" if self.reentrant else "non-reentrant"
        if self.policy != "full":
            kind += f", {self.policy}"
        limit = "" if self.max_modules is None else f"; first {self.max_modules} only"
        inert = "".join(f"; {k}: {INERT_KEYS[k]}" for k in self.inert)
        return f"checkpoint({', '.join(_target_name(t) for t in self.targets)}; {kind}{limit}{inert})"

    def sort_key(self):
        key = (tuple(_target_name(t) for t in self.targets), self.reentrant, self.max_modules, self.inert)
        if self.policy != "full":  # the full policy's key is unchanged: plans saved before it existed still match
            key += (self.policy,)
        return (int(self.contract.stage), self.name, repr(key))

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        found = outermost_matches(state.model, self.targets)
        if not found:
            raise ConfigError(
                "checkpoint targets",
                tuple(_target_name(t) for t in self.targets),
                f"classes or names of modules in {type(state.model).__name__} (none matched)",
            )
        matched = len(found)
        if self.max_modules is not None:
            found = found[: self.max_modules]
        uncached = 0
        for _, module in found:
            uncached += takes_cache(module)
            if self.reentrant:
                if getattr(module.forward, "_composable_atorch_reentrant", False):  # applied once per module
                    continue
                wrap_reentrant(module)
            else:
                checkpoint_first(module, context_fn=selective_contexts if self.policy == "selective" else None)
            cache_guard(module)
        if self.max_modules is not None:
            state.note(
                self.name,
                f"max_checkpoint_module_num={self.max_modules}: {len(found)} of {matched} matching modules "
                "checkpointed",
            )
        for key in self.inert:
            state.note(self.name, f"{key}: {INERT_KEYS[key]}")
        if self.policy == "selective":
            state.note(self.name, describe_saved())
        if not found:
            return state
        if uncached:
            state.note(
                self.name,
                f"{uncached} checkpointed block(s) take a key/value cache: dropped in training while empty (what a "
                "model with use_cache on builds for itself), as Hugging Face's own gradient checkpointing does (the "
                "recompute would append every block's keys and values again); a call whose cache already holds tokens "
                "(a prefix) runs without checkpointing, so the recompute never reads a cache the forward changed",
            )
        names = sorted({type(m).__name__ for _, m in found})
        state.note(
            self.name,
            f"{len(found)} module(s) checkpointed ({', '.join(names)}): "
            f"{', '.join(q or '<root>' for q, _ in found[:6])}{' ...' if len(found) > 6 else ''}",
        )
        return state


#: what a checkpointed block keeps for its backward: its inputs only, or the expensive ops' outputs too
POLICIES = ("full", "selective")

#: ATorch checkpoint keys accepted with no effect here, and why (shown in explain()).
INERT_KEYS = {
    "use_te_impl": "no effect: transformer-engine's checkpoint needs a CUDA GPU and the transformer-engine package; "
    "torch's is used",
    "selective_offload": "no effect on a CPU: it offloads saved activations from GPU memory to host memory, where they "
    "already are",
}
SEED_KEYS = ("wrap_class", "no_reentrant", "max_checkpoint_module_num", "selective_offload", "use_te_impl")


def _from_seed_dict(cfg: dict) -> Checkpoint:
    """ATorch's dict config, each key with ATorch's meaning (checkpoint_optimization.py)."""
    unknown = sorted(set(cfg) - set(SEED_KEYS))
    if unknown:
        raise ConfigError(
            f"checkpoint config key {unknown[0]!r}", cfg[unknown[0]], ", ".join(repr(k) for k in SEED_KEYS)
        )
    if "wrap_class" not in cfg:
        raise ConfigError(
            "checkpoint config key 'wrap_class'",
            None,
            "the block classes or names to checkpoint, e.g. {'wrap_class': (Block,)}",
        )
    wrap = cfg["wrap_class"]
    inert = []
    offload = cfg.get("selective_offload")
    no_reentrant = cfg.get("no_reentrant")
    if offload is not None:
        if (
            no_reentrant is not None and not no_reentrant
        ):  # ATorch raises too: selective offloading needs the non-reentrant checkpoint
            raise ConfigError(
                "checkpoint config 'no_reentrant'",
                False,
                "True (or absent) with 'selective_offload': it needs the non-reentrant checkpoint",
            )
        if not isinstance(offload, dict) or "offload_args" not in offload or "num_layers" not in offload:
            raise ConfigError(
                "checkpoint config 'selective_offload'",
                offload,
                "a dict with 'offload_args' and 'num_layers' (as ATorch)",
            )
        inert.append("selective_offload")
    if cfg.get("use_te_impl"):
        inert.append("use_te_impl")
    limit = cfg.get("max_checkpoint_module_num")
    return Checkpoint(
        targets=wrap if isinstance(wrap, tuple | list) else (wrap,),
        reentrant=no_reentrant is not None and not no_reentrant,
        max_modules=limit,
        inert=tuple(inert),
    )


def checkpoint(*targets, reentrant: bool = False, max_modules: int | None = None, policy: str = "full") -> Checkpoint:
    """``checkpoint(Block)``, ``checkpoint("Block", "mlp")``, ``checkpoint(Block, policy="selective")``,
    or ATorch's dict form.

    The dict form is ATorch's ``{"wrap_class": (Block,), "no_reentrant": False,
    "max_checkpoint_module_num": 4, "selective_offload": {...}, "use_te_impl": False}``.
    """
    if len(targets) == 1 and isinstance(targets[0], dict):
        seeded = _from_seed_dict(dict(targets[0]))
        return seeded if policy == "full" else replace(seeded, policy=policy)
    if len(targets) == 1 and isinstance(targets[0], tuple | list):
        targets = tuple(targets[0])
    return Checkpoint(targets=tuple(targets), reentrant=reentrant, max_modules=max_modules, policy=policy)

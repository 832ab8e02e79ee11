"""Memory: activation checkpointing of chosen blocks, keeping parameter names.

torch's ``checkpoint_wrapper`` renames parameters (``._checkpoint_wrapped_module.``), which would
break optimizer rebinding and saved state dicts; the composable
``torch.distributed._composable.checkpoint`` works in place and keeps names, so it is the default.
The reentrant variant (for models with ``@torch.jit.script`` parts, as the seed notes) wraps the
block's forward in place, which also keeps names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.utils.checkpoint as torch_checkpoint
from torch.distributed._composable import checkpoint as composable_checkpoint

from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.transforms._util import outermost_matches


def _target_name(t) -> str:
    return t.__name__ if isinstance(t, type) else t


@dataclass(frozen=True)
class Checkpoint(Transform):
    """Recompute the activations of each matching block in the backward pass instead of storing them."""

    name = "checkpoint"
    contract = Contract(stage=Stage.CHECKPOINT, roles=("activation_checkpoint",))

    targets: tuple = ()
    reentrant: bool = False

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, type | str):
            targets = (targets,)
        targets = tuple(targets)
        if not targets:
            raise ConfigError("checkpoint targets", targets, "at least one block class, class name or module name")
        bad = [t for t in targets if not isinstance(t, type | str)]
        if bad:
            raise ConfigError("checkpoint target", bad[0], "a module class, a class name or a module's qualified name")
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "reentrant", bool(self.reentrant))

    @classmethod
    def candidates(cls, search):
        return tuple(cls(targets=(b,)) for b in search.block_classes)

    @classmethod
    def from_seed(cls, config=None):
        """Seed config: a tuple of classes/names, or ``{"wrap_class": ..., "no_reentrant": ...}``."""
        if config is None:
            raise ConfigError("checkpoint config", None, "the block classes or names to checkpoint, e.g. (Block,)")
        return checkpoint(config)

    def describe(self):
        kind = "reentrant" if self.reentrant else "non-reentrant"
        return f"checkpoint({', '.join(_target_name(t) for t in self.targets)}; {kind})"

    def sort_key(self):
        return (int(self.contract.stage), self.name, repr((tuple(_target_name(t) for t in self.targets), self.reentrant)))

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        found = outermost_matches(state.model, self.targets)
        if not found:
            raise ConfigError(
                "checkpoint targets",
                tuple(_target_name(t) for t in self.targets),
                f"classes or names of modules in {type(state.model).__name__} (none matched)",
            )
        for _, module in found:
            if self.reentrant:
                inner = module.forward
                module.forward = functools.partial(torch_checkpoint.checkpoint, inner, use_reentrant=True)
            else:
                composable_checkpoint(module)
        names = sorted({type(m).__name__ for _, m in found})
        state.note(self.name, f"{len(found)} module(s) checkpointed ({', '.join(names)}): {', '.join(q or '<root>' for q, _ in found[:6])}{' ...' if len(found) > 6 else ''}")
        return state


def checkpoint(*targets, reentrant: bool = False) -> Checkpoint:
    """``checkpoint(Block)``, ``checkpoint("Block", "mlp")``, or the seed's dict form.

    The dict form is ``{"wrap_class": (Block,), "no_reentrant": False}``.
    """
    if len(targets) == 1 and isinstance(targets[0], dict):
        cfg = dict(targets[0])
        unknown = set(cfg) - {"wrap_class", "no_reentrant"}
        if unknown:
            raise ConfigError(f"checkpoint config key {sorted(unknown)[0]!r}", cfg[sorted(unknown)[0]], "'wrap_class', 'no_reentrant'")
        wrap = cfg.get("wrap_class", ())
        return Checkpoint(targets=wrap if isinstance(wrap, tuple | list) else (wrap,), reentrant=not cfg.get("no_reentrant", True))
    if len(targets) == 1 and isinstance(targets[0], tuple | list):
        targets = tuple(targets[0])
    return Checkpoint(targets=tuple(targets), reentrant=reentrant)

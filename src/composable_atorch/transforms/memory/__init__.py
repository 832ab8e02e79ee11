"""Memory: activation checkpointing (:mod:`.transform`) and how a checkpointed block recomputes
(:mod:`.recompute`: the selective policy, the reentrant wrapper, the key/value cache guard)."""

from composable_atorch.transforms.memory.transform import Checkpoint, checkpoint

__all__ = ["Checkpoint", "checkpoint"]

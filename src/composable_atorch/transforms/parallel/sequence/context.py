"""``context_parallel()``: each rank of the ``("context", n)`` dimension holds 1/n of every sequence.

The loader gives rank ``i`` chunks ``i`` and ``2n-1-i`` of ``2n`` (load balancing for causal
masks), the model receives their global ``position_ids`` (rotary and absolute positions as in one
process), and attention all-gathers keys and values over the context group with a causal mask over
global positions: the same attention as one process, computed for 1/n of the queries per rank.
Activations outside attention scale with 1/n of the sequence. ``rotation="ring"`` passes the
key/value blocks around the group instead (:mod:`.ring`: online softmax, its own backward), so
attention's memory is the rank's part too; all-gather stays the default, faster on CPU/gloo (one
collective and one fused attention against ``n`` point-to-point rounds of unfused matmuls).

torch's ``torch.distributed.tensor.experimental.context_parallel`` is not used: on this torch
(2.13) it has no sharding rule for the CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``:
NotImplementedError on gloo) and it patches SDPA process-wide; the collectives here run on any
backend and are scoped to the one model.
"""

from __future__ import annotations

from dataclasses import dataclass

from composable_atorch.core.contract import Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.axes import CONTEXT
from composable_atorch.transforms.parallel.sequence.common import (
    after_tensor_parallel,
    apply_split,
    group_note,
    model_parallel_conflicts,
    split_options,
)

ROTATIONS = ("allgather", "ring")


@dataclass(frozen=True)
class ContextParallel(Transform):
    """Split every sequence over parallel_mode's ``context`` dimension (keys/values all-gathered)."""

    name = "context_parallel"
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        roles=("sequence_split",),
        reads=("checkpoint", "pipeline_parallel"),
        orders=(after_tensor_parallel("context_parallel"),),
        axis=CONTEXT,
        conflicts=model_parallel_conflicts("context_parallel"),
    )

    #: pass global ``position_ids`` to the model's forward (False: a model without positions)
    positions: bool = True
    #: how keys and values reach every rank: ``"allgather"`` (one all-gather, then one fused attention;
    #: the faster on CPU) or ``"ring"`` (passed around the context group block by block, partial
    #: attentions merged by their log-sum-exps; per-rank memory of the rank's own part only)
    rotation: str = "allgather"

    def __post_init__(self):
        if not isinstance(self.positions, bool):
            raise ConfigError("context_parallel.positions", self.positions, "True or False")
        if self.rotation not in ROTATIONS:
            raise ConfigError("context_parallel.rotation", self.rotation, " or ".join(map(repr, ROTATIONS)))

    @classmethod
    def candidates(cls, search):
        """One option per context degree n the model and its first batch admit
        (:func:`~.common.split_options`): sequences in 2n load-balanced chunks."""
        return split_options(
            cls(),
            "context",
            search,
            lambda n, length, _heads: length % (2 * n) == 0,
            lambda n, data: (
                f"context {n} x data {data}: each rank holds 1/{n} of every sequence (load-balanced chunks), "
                "keys and values all-gathered for attention"
            ),
        )

    def describe(self):
        how = "passed around a ring" if self.rotation == "ring" else "all-gathered"
        return (
            "context_parallel(each rank holds 1/n of every sequence: load-balanced chunks i and 2n-1-i, keys and "
            f"values {how} for attention, positions global, loss and gradients over the whole sequence)"
        )

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        state = apply_split(self, state, ctx, "context", "context", self.positions, self.rotation)
        n = state.parallel.layout.size("context") if state.parallel is not None else 1
        if n > 1 and state.parallel.distributed:
            state.note(
                self.name,
                f"context {n}: each rank holds 1/{n} of every sequence (chunks rank and {2 * n - 1}-rank of {2 * n}); "
                + group_note(n, "context"),
            )
        return state


def context_parallel(*, positions: bool = True, rotation: str = "allgather") -> ContextParallel:
    """``context_parallel()`` with ``parallel_mode([("context", n), ("data", m)])``; ``rotation="ring"``
    passes keys and values around the context group instead of all-gathering them."""
    return ContextParallel(positions=positions, rotation=rotation)

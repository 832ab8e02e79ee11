"""ATorch's ``sequence_parallel`` (DeepSpeed-Ulysses): its own ``("sequence", n)`` group of ranks,
independent of the data group.

Each rank holds a contiguous ``1/n`` of every sequence; around attention an all-to-all turns
"my tokens, all heads" into "all tokens, my heads" (heads must divide by ``n``) and back, so each
rank computes exact attention over the whole sequence for ``1/n`` of the heads; everything else is
data-parallel over the sequence (gradients averaged over the sequence group). ATorch's
``{"sp_size": n, "batch_sp_processing_fn": f}``: ``sp_size`` is the sequence size of
``parallel_mode``; the batch function is not needed (the plan's loader splits each sequence).
Megatron-style sequence parallelism (norms and dropout on a sequence shard of the *tensor* group)
is ``tensor_parallel(sequence_parallel=True)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform, build
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.axes import SEQUENCE
from composable_atorch.transforms.parallel.sequence.common import (
    after_tensor_parallel,
    apply_split,
    group_note,
    model_parallel_conflicts,
    seed_size,
    split_options,
)


def _sp_size_differs(mine, pm) -> bool:
    return mine.sp_size is not None and dict(pm.groups).get("sequence") != mine.sp_size


#: ATorch's keys naming the modules whose ``set_sp(sp_size, sp_rank, sp_group)`` it calls. Here no
#: ``set_sp`` is called: the all-to-all is placed at the model's attention (transformers' attention
#: interface or ``scaled_dot_product_attention``), so a model whose ``set_sp`` was never called trains
#: as a plain one under the split (ATorch's own GPT-2 toy's ``set_sp`` patches ``GPT2Attention._attn``,
#: which transformers 5 removed, and could not run there).
SET_SP_KEYS = {
    "module": "no effect: set_sp is not called; the all-to-all is placed at the model's attention",
    "set_sp_func_name": "no effect: set_sp is not called; the all-to-all is placed at the model's attention",
}


@dataclass(frozen=True)
class Ulysses(Transform):
    """Ulysses sequence parallelism over parallel_mode's ``sequence`` dimension (ATorch's ``sequence_parallel``)."""

    name = "sequence_parallel"
    aliases = ("ulysses",)
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        roles=("sequence_split",),
        reads=("checkpoint", "pipeline_parallel"),
        orders=(after_tensor_parallel("sequence_parallel"),),
        axis=SEQUENCE,
        conflicts=(
            Conflict(
                "parallel_mode",
                "sequence_parallel's sp_size is the sequence size of parallel_mode, and the two differ",
                "give parallel_mode ('sequence', sp_size), or drop sp_size",
                when=_sp_size_differs,
            ),
            *model_parallel_conflicts("sequence_parallel"),
        ),
    )

    #: ATorch's sp_size: the sequence size of parallel_mode (None: whatever parallel_mode says)
    sp_size: int | None = None
    #: pass global ``position_ids`` to the model's forward (False: a model without positions)
    positions: bool = True
    #: ATorch's keys naming the modules whose ``set_sp`` it calls, accepted with no effect (named in explain())
    inert: tuple[str, ...] = ()

    def __post_init__(self):
        seed_size(self.sp_size, "sequence_parallel.sp_size")
        if not isinstance(self.positions, bool):
            raise ConfigError("sequence_parallel.positions", self.positions, "True or False")
        inert = tuple(sorted(set(self.inert))) if isinstance(self.inert, list | tuple) else self.inert
        bad = [k for k in inert if k not in SET_SP_KEYS] if isinstance(inert, tuple) else [inert]
        if bad:
            raise ConfigError("sequence_parallel.inert", bad[0], f"a list of names from {list(SET_SP_KEYS)}")
        object.__setattr__(self, "inert", inert)

    @classmethod
    def candidates(cls, search):
        """One option per sequence degree n the model and its first batch admit
        (:func:`~.common.split_options`): sequences and heads both divisible by n."""
        return split_options(
            cls(),
            "sequence",
            search,
            lambda n, length, heads: length % n == 0 and bool(heads) and heads % n == 0,
            lambda n, data: (
                f"sequence {n} x data {data} (Ulysses): each rank holds 1/{n} of every sequence, all-to-all "
                f"to 1/{n} of the heads for attention"
            ),
        )

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's ``{"sp_size": n, "batch_sp_processing_fn": f, "module": cls, "set_sp_func_name": name}``:
        the function is not needed (the plan's loader splits each sequence); ``module`` /
        ``set_sp_func_name`` are accepted and no ``set_sp`` is called (see :data:`SET_SP_KEYS`)."""
        if isinstance(config, dict):
            inert = tuple(k for k in SET_SP_KEYS if k in config)
            kept = {k: v for k, v in config.items() if k != "batch_sp_processing_fn" and k not in SET_SP_KEYS}
            return super().from_seed({**kept, **({"inert": inert} if inert else {})})
        return super().from_seed(config)

    def adjust_seed_list(self, transforms):
        """sp_size becomes parallel_mode's sequence size: added to its groups when they have no sequence
        dimension (the data size absorbs the rest), or parallel_mode([("sequence", sp_size), ("data", 1)])
        when the strategy has none and sp_size is not the implied 2; a different sequence size there contradicts it."""
        sp = self.sp_size
        if sp is None:
            return transforms
        pm = next((t for t in transforms if t.name == "parallel_mode"), None)
        if pm is None:  # sequence 2 is what the contract's implication adds (in a world where the step runs)
            return (
                transforms
                if sp == 2
                else (build("parallel_mode", {"groups": (("sequence", sp), ("data", 1))}), *transforms)
            )
        size = dict(pm.groups).get("sequence")
        if size is not None and size != sp:
            raise ConfigError("sequence_parallel.sp_size", sp, f"parallel_mode's sequence size {size}, or no sp_size")
        if size is None:
            pm2 = dataclasses.replace(pm, groups=(("sequence", sp), *pm.groups))
            return tuple(pm2 if t is pm else t for t in transforms)
        return transforms

    def describe(self):
        sp = "" if self.sp_size is None else f"sp_size {self.sp_size}: "
        inert = "".join(f"; {k}: {SET_SP_KEYS[k]}" for k in self.inert)
        return (
            f"sequence_parallel({sp}Ulysses: each rank holds 1/n of every sequence, an all-to-all gives attention "
            f"the whole sequence for 1/n of the heads and back; the rest data-parallel over the sequence{inert})"
        )

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        state = apply_split(self, state, ctx, "sequence", "ulysses", self.positions)
        n = state.parallel.layout.size("sequence") if state.parallel is not None else 1
        if n > 1 and state.parallel.distributed:
            state.note(
                self.name,
                f"sequence {n}: each rank holds a contiguous 1/{n} of every sequence and 1/{n} of the heads inside "
                "attention; " + group_note(n, "sequence"),
            )
        return state


def sequence_parallel(sp_size: int | None = None, *, positions: bool = True) -> Ulysses:
    """ATorch's ``sequence_parallel``: Ulysses over parallel_mode's ``("sequence", n)``.

    Megatron-style sequence parallelism is ``tensor_parallel(sequence_parallel=True)``.
    """
    return Ulysses(sp_size=sp_size, positions=positions)

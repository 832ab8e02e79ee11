"""``expert_parallel()``: each rank of the ``("expert", n)`` dimension holds 1/n of every MoE layer's experts.

What changes, and why it trains the same model as one process:

* The experts modules (see :mod:`.families` for the protocol; transformers 5's Mixtral, Qwen2/3-MoE,
  DeepSeek-V3 and GPT-OSS follow it) keep experts ``[r * E/n, (r+1) * E/n)`` on expert rank ``r``:
  each stacked parameter is sliced along its first dimension, under its own name (the plan rebuilds
  the optimizer by name), and the forward dispatches tokens with all-to-all (:mod:`.dispatch`).
  Nothing is dropped: every token reaches every expert it was routed to.
* The expert dimension is a batch dimension (``runtime.layout.BATCH_DIMS``): the ranks of an expert
  group read different samples, so the loader splits the global batch over expert x data, and the
  non-expert parameters (attention, router, shared experts, embeddings) are replicated and averaged
  over expert x data by ddp / fsdp (the context's data mesh is that flattened group).
* An expert's gradient gathers every token routed to it from any rank of its expert group; the
  dispatch makes it their mean (:mod:`.dispatch`), and the ranks holding the same experts (the
  ``data`` dimension) average theirs as for any replicated parameter: ddp in a hook before the step
  (the experts kept out of its replicate), fsdp by sharding the experts over the data dimension only
  (ATorch's ``expert_fsdp``).
* Router, shared experts and any auxiliary load-balancing loss are untouched; like any data-parallel
  step, each rank's auxiliary loss is computed over its own tokens.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from composable_atorch.core.context import NotOffered
from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import CompositionError
from composable_atorch.runtime.axes import EXPERT
from composable_atorch.runtime.mesh import ExpertLayout
from composable_atorch.transforms.parallel.expert.dispatch import dispatch_forward
from composable_atorch.transforms.parallel.expert.families import family, find_experts
from composable_atorch.transforms.parallel.shared.options import layout_option
from composable_atorch.transforms.parallel.shared.sync import parallel_context

#: the attribute an expert-parallel experts module carries (its :class:`ExpertShard`)
SHARD_ATTR = "expert_parallel"


@dataclass(frozen=True)
class ExpertShard:
    """Which experts this rank holds of one experts module, and the group it dispatches over."""

    degree: int
    rank: int
    per_rank: int
    total: int
    group: object
    #: the 1-D expert mesh (checkpoints write the local experts as its Shard(0) of the whole)
    mesh: object = None

    @property
    def first(self) -> int:
        return self.rank * self.per_rank

    def __deepcopy__(self, memo):  # a probe's replica shares the group (process groups do not copy)
        return self


def _not_fsdp_backend(_mine, theirs) -> bool:
    return getattr(theirs, "backend", "fsdp") not in ("fsdp", "torch")


SPLIT = "each expert rank holds other experts under the same names"


@dataclass(frozen=True)
class ExpertParallel(Transform):
    """Split every MoE layer's experts over the ``expert`` dimension of ``parallel_mode``; all-to-all dispatch.

    The degree is parallel_mode's ``("expert", n)`` (implied as ``expert 2 x data rest``). Compose
    with ``fsdp`` to shard the non-expert parameters over the whole world and the experts over the
    data dimension (ATorch's ``expert_fsdp``), or with ``ddp`` (the default) to replicate them.
    """

    name = "expert_parallel"
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        roles=("expert_parallel",),
        axis=EXPERT,
        conflicts=(
            Conflict(
                "zero1",
                f"zero1's optimizer broadcasts each parameter from one rank of expert x data, but {SPLIT}",
                "use fsdp() (experts sharded over the data dimension) or ddp",
            ),
            Conflict(
                "zero2",
                f"this zero2 backend shards over expert x data as if every rank held the same parameters, but {SPLIT}",
                "use zero2() (its FSDP backend) or fsdp()",
                when=_not_fsdp_backend,
            ),
            Conflict(
                "fsdp",
                f"DeepSpeed ZeRO-3 partitions over expert x data as if each rank held the same parameters, but {SPLIT}",
                "use fsdp() with its torch backend",
                when=_not_fsdp_backend,
            ),
            Conflict(
                "model_parallel",
                "expert parallelism beside tensor / pipeline parallelism is not built in this version (their "
                "gradient sync would average each rank's own experts with other ranks' as if replicated)",
                "drop one of them: expert_parallel composes with ddp, fsdp and checkpoint",
            ),
            Conflict(
                "clip_grad",
                "the gradient norm would count only this rank's experts (the norm over expert ranks is not built)",
                "drop clip_grad, or clip inside the MoE-free part of the model yourself",
            ),
        ),
    )

    @classmethod
    def candidates(cls, search):
        """One option per expert degree n that every MoE layer's expert count divides (:meth:`check` on the
        search's model), where the global batch splits over the world (the expert dimension is a batch
        dimension); why not, when no MoE layer splits in two."""
        if search.model is None or search.env.world_size < 2:
            return ()
        step, world, fitting = cls(), search.env.world_size, []
        for n in search.degrees:
            try:
                step.check(search.model.model, n)
            except CompositionError as exc:
                if n == 2:
                    return (NotOffered("expert parallelism", f"{getattr(exc, 'problem', exc)}"),)
                continue
            fitting.append(n)
        if search.batch_size % world:
            why = f"the global batch {search.batch_size} does not split over {world}"
            return tuple(NotOffered(f"expert {n}", why) for n in fitting)
        return tuple(
            layout_option(
                "expert",
                n,
                world,
                f"expert {n} x data {world // n}: each rank holds 1/{n} of every MoE layer's experts, tokens sent "
                "to their experts by all-to-all",
                step,
            )
            for n in fitting
        )

    def describe(self):
        return "expert_parallel(experts split over the expert dim, all-to-all token dispatch, no capacity drop)"

    def check(self, model: nn.Module, degree: int = 2) -> list[str]:
        """What would be split at ``degree``, without touching the model (ExpertParallelError if nothing can be)."""
        found = find_experts(model, degree)
        return [
            f"{n}: {family(m)}, {m.num_experts} experts -> {m.num_experts // degree} per rank" for n, m in found.items()
        ]

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        pc = parallel_context(state, self.name)
        degree = pc.layout.size("expert")
        model = state.model
        found = find_experts(model, degree)  # every check before any change
        families = sorted({family(m) for m in found.values()})
        if not pc.distributed or degree == 1:
            state.note(
                self.name,
                f"expert degree {degree}{'' if pc.distributed else ', no process group'}: experts left whole "
                f"({len(found)} {', '.join(families)} layer(s) would split)",
            )
            return state
        group = pc.mesh["expert"].get_group()
        rank = pc.layout.coordinate(pc.rank, "expert")
        batch_group = pc.data_group()
        held = full = 0
        for m in found.values():
            pc.applied.record(self.name, m)
            shard = ExpertShard(degree, rank, m.num_experts // degree, m.num_experts, group, pc.mesh["expert"])
            _keep_local(m, shard, batch_group)
            held += sum(p.numel() for p in m.parameters())
            full += sum(p.numel() for p in m.parameters()) * degree
        pc.experts = ExpertLayout(tuple(found.values()), pc.mesh["data"] if "data" in pc.layout.names else None)
        first = getattr(next(iter(found.values())), SHARD_ATTR)
        state.note(
            self.name,
            f"{len(found)} {', '.join(families)} experts layer(s) split over the expert dim of {degree}: this rank "
            f"holds experts {first.first}..{first.first + first.per_rank - 1} of {first.total} per layer, {held:,} of "
            f"{full:,} expert parameters; tokens go to their experts' ranks and back by all-to-all, none dropped",
        )
        state.note(
            self.name,
            f"the expert dim is a batch dimension: the global batch is split over {pc.layout.describe()}; router, "
            "shared experts and other parameters replicated and averaged over expert x data; expert gradients "
            f"averaged over the expert group by the dispatch, then over their {pc.layout.size('data')} data replica(s)",
        )
        return state


def _keep_local(module: nn.Module, shard: ExpertShard, batch_group) -> None:
    """Slice every stacked parameter to this rank's experts (rank 0's full weights first, so every
    rank slices the same model) and route the forward through the dispatcher."""
    lo, hi = shard.first, shard.first + shard.per_rank
    local_forward = type(module).forward
    with torch.no_grad():
        for name, p in list(module.named_parameters()):
            dist.broadcast(p.data, group=batch_group, group_src=0)
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            setattr(owner, leaf, nn.Parameter(p.data[lo:hi].clone(), requires_grad=p.requires_grad))
    module.num_experts = shard.per_rank
    setattr(module, SHARD_ATTR, shard)

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        return dispatch_forward(self, local_forward, hidden_states, top_k_index, top_k_weights)

    module.forward = types.MethodType(forward, module)


def expert_parallel() -> ExpertParallel:
    """``expert_parallel()`` with ``parallel_mode([("expert", n), ("data", m)])``: experts split n ways."""
    return ExpertParallel()

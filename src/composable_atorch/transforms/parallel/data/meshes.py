"""Which mesh fsdp / zero2 shard over: flat over the data ranks, hybrid (HSDP) over parallel_mode's
``zero`` dimension or over the nodes (ATorch's ``HYBRID_SHARD``), and the experts of expert parallelism
over their replicas (ATorch's ``expert_fsdp``). Split from :mod:`.sharding`, which applies FSDP2.

The search's layouts: :func:`layout_option` (a step over one dimension of ``parallel_mode``, the data
dimension the rest: how every axis offers its degrees) and :func:`hybrid_option` (the ``zero x data``
layout fsdp, zero2 and zero1 offer on several nodes).
"""

from __future__ import annotations

from composable_atorch.core.context import NotOffered, SearchContext
from composable_atorch.core.transform import ApplyContext, TrainState
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.shared.options import layout_option


def shard_mesh(pc, spec, ctx: ApplyContext, state: TrainState, who: str):
    """``(mesh, what explain() says)``: the mesh fully_shard shards over.

    ``spec`` is fsdp's or zero2's spec (only its ``hybrid`` flag is read here; not imported, so this module
    stays below :mod:`.sharding` in the import graph).

    A ``zero`` dimension > 1 gives hybrid sharding (HSDP): torch's 2-D ``(replicate, shard)`` mesh
    ``(data, zero)``, gradients reduce-scattered inside a zero group and all-reduced across the data
    replicas. Without one, ATorch's ``sharding_strategy=HYBRID_SHARD`` (``spec.hybrid``) takes the groups
    from the world: shard inside a node, replicate across nodes (:func:`world_hybrid_mesh`).
    Otherwise flat sharding over all data ranks.
    """
    hybrid = pc.hybrid_mesh()
    zero, data = pc.zero_size, pc.layout.size("data")
    if hybrid is not None:
        if spec.hybrid:
            state.note(who, "sharding_strategy=HYBRID_SHARD: the shard groups are parallel_mode's 'zero' dimension")
        return hybrid, (
            f"hybrid (HSDP, 2-D mesh (data, zero)): each parameter sharded over a zero group of {zero}, replicated "
            f"over data {data}; gradients reduce-scattered in the zero group, all-reduced across the replicas"
        )
    if zero > 1:
        return pc.data_mesh(), f"over the zero group of {zero} (data 1: no replicas)"
    if spec.hybrid:
        return world_hybrid_mesh(pc, ctx, state, who)
    return pc.data_mesh(), f"over {pc.data_size} ranks"


def world_hybrid_mesh(pc, ctx: ApplyContext, state: TrainState, who: str):
    """HYBRID_SHARD with the groups taken from the world, as FSDP1 does: a ``(nodes, processes per node)``
    mesh of the data ranks (``Environment.nodes``, from torchrun's LOCAL_WORLD_SIZE)."""
    from torch.distributed.device_mesh import DeviceMesh

    env = ctx.env
    per, nodes = env.processes_per_node, env.nodes
    if pc.data_size != pc.layout.world_size:
        raise ConfigError(
            "fsdp sharding_strategy",
            "HYBRID_SHARD",
            f"with model parallelism in the layout ({pc.layout.describe()}), name the shard group: "
            "parallel_mode([('zero', n), ..., ('data', m)]) shards over zero and replicates over data",
        )
    if nodes == 1 or per == 1:
        state.note(
            who,
            f"sharding_strategy=HYBRID_SHARD on {nodes} node(s) of {per} process(es): nothing to "
            + ("replicate across, sharded over the node" if nodes == 1 else "shard inside a node, sharded flat"),
        )
        return pc.data_mesh(), f"over {pc.data_size} ranks"
    ranks = pc.data_mesh().mesh.reshape(nodes, per)
    mesh = DeviceMesh(env.device, ranks, mesh_dim_names=("replicate", "shard"))
    state.note(
        who,
        f"sharding_strategy=HYBRID_SHARD: groups taken from the world ({env.describe()}): shard inside each node "
        f"of {per}, replicate across {nodes} nodes (give ('zero', n) in parallel_mode to choose them)",
    )
    return mesh, f"hybrid (HSDP, 2-D mesh (nodes {nodes}, per node {per}))"


def shard_experts(experts: list, pc, kwargs: dict, state: TrainState, who: str) -> None:
    """Expert parallelism (ATorch's expert_fsdp): each experts module sharded over the ranks holding the
    same experts (the data dimension), which average its gradient (already the mean over its expert
    group: expert_parallel's dispatch scales it); without a data dimension the experts stay whole, kept
    out of the parent groups."""
    from torch.distributed.fsdp import fully_shard

    if not experts:
        return
    replicas = pc.experts.replica_mesh
    if replicas is None:
        params = {p for m in experts for p in m.parameters()}
        kwargs["ignored_params"] = (kwargs.get("ignored_params") or set()) | params
        state.note(who, f"{len(experts)} experts module(s) kept whole (no data dimension to shard them over)")
        return
    for m in experts:
        fully_shard(m, mesh=replicas, **kwargs)
    state.note(
        who,
        f"{len(experts)} experts module(s) sharded over the data dim of {replicas.size()} (expert_fsdp); the rest "
        f"over expert x data ({pc.data_size} ranks)",
    )


# -- the search's layouts ------------------------------------------------------------------------------


def hybrid_option(search: SearchContext) -> tuple:
    """On several nodes, ``zero <per node> x data <nodes>``: with fsdp / zero2 that is hybrid sharding
    (HSDP: shard inside a node, replicate across nodes), with zero1 optimizer state sharded inside a
    node. Its rule (:func:`hybrid_admit`) refuses the plans it would list twice."""
    env = search.env
    per = env.processes_per_node
    if env.nodes < 2 or per < 2:
        return ()
    if search.batch_size % env.world_size:
        why = f"the global batch {search.batch_size} does not split over {env.world_size}"
        return (NotOffered("hybrid sharding", why),)
    label = (
        f"zero {per} x data {env.nodes}: with fsdp / zero2, hybrid sharding (HSDP) inside each node of {per}, "
        f"replicated across {env.nodes} nodes"
    )
    return (layout_option("zero", per, env.world_size, label, admit=hybrid_admit),)


def hybrid_admit(plan) -> str | None:
    """While the ``zero x data`` layout is offered: a ``zero`` dimension without fsdp / zero2 / zero1 shards
    nothing (ddp over data x zero is the plan without it), and ``fsdp(hybrid=True)`` is the same hybrid
    sharding, listed once by the explicit layout (a trial's processes run on one machine, where the
    world's nodes are not there to take the groups from)."""
    names = set(plan.names)
    layout = next((t for t in plan.transforms if t.name == "parallel_mode"), None)
    if layout is not None and dict(layout.groups).get("zero", 1) > 1 and not names & {"fsdp", "zero2", "zero1"}:
        return (
            "invalid for the search: the 'zero' dimension shards nothing without fsdp / zero2 / zero1 "
            "(ddp over data x zero is the plan without it)"
        )
    if any(t.name == "fsdp" and getattr(t, "hybrid", False) for t in plan.transforms):
        return (
            "invalid for the search: fsdp(hybrid=True) is the hybrid sharding the zero x data layout of the "
            "parallel_mode knob gives; listed once, by that layout"
        )
    return None

"""A simulated rank's step priced on paper: its ordered ops on a Hardware, on two streams.

:func:`price_run` turns one :class:`~composable_atorch.estimate.simulate.RankRun` (traced with
:class:`~.trace.OrderedTrace`) into a :class:`RankStep`: each compute op priced by :mod:`.ops`
(after the compile rule of :mod:`.fusion` where the plan compiles), each collective by :mod:`.comm`
over its own group's ranks and the nodes they span, DDP's bucket all-reduces (which the fake world
does not run) added over the last backward in the order their buckets fill, and the whole laid on
the two streams of :mod:`.timeline`. :func:`step` combines the ranks of a pipeline's stages and
adds the schedule's bubble (:mod:`.schedules`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from composable_atorch.estimate.paper import comm, ops, schedules, timeline
from composable_atorch.estimate.paper.fusion import fuse
from composable_atorch.estimate.paper.timeline import Slot
from composable_atorch.estimate.paper.utilization import matmul_dtype
from composable_atorch.hardware import Hardware

#: mesh dimensions whose collectives feed the very next compute
BLOCKING_DIMS = {"tensor", "sequence", "expert", "context"}


@dataclass(frozen=True)
class Setting:
    """What pricing needs beyond the trace: the device, the world's shape, and the plan's knobs."""

    hardware: Hardware
    world: int
    nodes: int = 1
    compiled: bool = False
    schedule: str = "1F1B"
    pipeline: int = 1
    stages_per_rank: int = 1
    #: the one layout dimension spanning the whole world, if the layout has one (a 1-D DeviceMesh
    #: runs on the default process group, which carries no mesh name): "data" without a layout
    world_dim: str = "data"

    @property
    def per_node(self) -> int:
        return max(1, self.world // self.nodes)


@dataclass(frozen=True)
class RankStep:
    """One rank's priced step before any pipeline bubble (seconds; ``flops``: as traced)."""

    seconds: float
    compute: float
    overhead: float
    exposed: float
    comm: float
    forward: float
    backward: float
    weight: float
    optimizer: float
    #: the dtype most of its matmul FLOPs run in on the device (the peak MFU is counted against)
    matmul_dtype: str = "bfloat16"

    def to_dict(self) -> dict:
        return asdict(self)

    def extrapolate(self, other: RankStep, k1: int, k2: int, n: int) -> RankStep:
        """The step of an ``n``-block model from this (``k1`` blocks) and ``other`` (``k2``), per block linear."""
        seconds = {
            f.name: max(
                0.0, getattr(self, f.name) + (n - k1) * (getattr(other, f.name) - getattr(self, f.name)) / (k2 - k1)
            )
            for f in fields(self)
            if isinstance(getattr(self, f.name), float)
        }
        return RankStep(**seconds, matmul_dtype=other.matmul_dtype)


def policy(ev, after_barrier: bool) -> str:
    """How a collective overlaps (:data:`.timeline.POLICIES`), from its kind and mesh dimension."""
    dims = set(ev.dim.split("_")) - {""}
    if after_barrier or ev.kind == "all_to_all":
        return "blocking"
    if ev.kind in ("p2p", "p2p_recv"):
        if "context" in dims:
            return "next"
        return "async" if ev.kind == "p2p" else "blocking"
    if dims & BLOCKING_DIMS:
        return "blocking"
    return "prefetch" if ev.kind == "all_gather" else "async"


def slots_of(events, setting: Setting) -> tuple[list[Slot], float]:
    """The events priced as timeline slots, and the backward's GEMM seconds (for W)."""
    hw = setting.hardware
    out: list[Slot] = []
    after_barrier, bwd_gemm, last_send = False, 0.0, None
    for ev in fuse(events) if setting.compiled else events:
        if ev.kind == "barrier":
            out.append(Slot("barrier"))
            after_barrier = True
        elif ev.comm:
            # a receive beside a send of its size travels the other way at the same time (full duplex)
            paired = ev.kind == "p2p_recv" and last_send == ev.size
            seconds = 0.0 if paired else comm.collective_s(hw, ev.kind, ev.size, ev.ranks, setting.per_node)
            last_send = ev.size if ev.kind == "p2p" else None
            if not ev.dim and len(ev.ranks) == setting.world:
                ev = replace(ev, dim=setting.world_dim)
            out.append(Slot("comm", seconds, policy=policy(ev, after_barrier)))
        else:
            seconds, work = ops.compute_op(hw, ev)
            out.append(Slot("compute", seconds, work, backward=ev.backward, optimizer=after_barrier))
            if ev.backward and ev.kind == "mm":
                bwd_gemm += seconds
    return out, bwd_gemm


def with_buckets(slots: list[Slot], buckets: list[float]) -> list[Slot]:
    """DDP's bucket all-reduces (priced, in ready order) issued over the backward before the first
    barrier: bucket ``k`` of ``K`` once ``(k + 1) / K`` of that backward's compute has run."""
    if not buckets:
        return slots
    stop = next((i for i, s in enumerate(slots) if s.kind == "barrier"), len(slots))
    start = max((i for i in range(stop) if slots[i].kind == "compute" and not slots[i].backward), default=-1) + 1
    total = sum(s.seconds for s in slots[start:stop] if s.kind == "compute")
    out, done, k = list(slots[:start]), 0.0, 0
    for s in slots[start:stop]:
        out.append(s)
        done += s.seconds if s.kind == "compute" else 0.0
        while k < len(buckets) and done >= total * (k + 1) / len(buckets) - 1e-15:
            out.append(Slot("comm", buckets[k], policy="async"))
            k += 1
    out += [Slot("comm", b, policy="async") for b in buckets[k:]]
    return out + list(slots[stop:])


def price_run(run, setting: Setting) -> RankStep:
    """One simulated rank's step on ``setting.hardware`` (see the module doc)."""
    trace = run.trace
    slots, bwd_gemm = slots_of(trace.events, setting)
    if run.allreduce_buckets:
        group = data_group(trace.mesh_groups, setting.world)
        priced = [
            comm.collective_s(setting.hardware, "all_reduce", float(b), group, setting.per_node)
            for b in run.allreduce_buckets
        ]
        slots = with_buckets(slots, priced)
    t = timeline.run(slots)
    return RankStep(
        t.total, t.compute, t.overhead, t.exposed, t.comm, t.forward, t.backward, bwd_gemm / 2, t.optimizer,
        matmul_dtype(trace.events),
    )


def data_group(groups: dict[str, tuple[int, ...]], world: int) -> tuple[int, ...]:
    """The ranks DDP all-reduces over: the largest mesh group over batch dimensions, else the world."""
    batch = [g for name, g in groups.items() if set(name.split("_")) <= {"data", "zero", "expert"}]
    return max(batch, key=len) if batch else tuple(range(world))


@dataclass(frozen=True)
class Step:
    """The step of the slowest rank, the pipeline's bubble added."""

    seconds: float
    compute: float
    comm: float
    overhead: float
    bubble: float
    comm_total: float
    optimizer: float
    stages: tuple[RankStep, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = [s.to_dict() for s in self.stages]
        return d


def step(ranks: list[RankStep], setting: Setting, microbatches: int) -> Step:
    """Combine the simulated ranks (one per pipeline stage, or one) into the step."""
    slow = max(ranks, key=lambda r: r.seconds)
    m = max(1, microbatches)
    idle = 0.0
    if setting.pipeline > 1:
        chunks = schedules.Chunks(slow.forward / m, slow.backward / m, slow.weight / m)
        idle = schedules.bubble(setting.schedule, setting.pipeline, setting.stages_per_rank, chunks)
    return Step(
        seconds=slow.seconds + idle,
        compute=slow.compute,
        comm=slow.exposed,
        overhead=slow.overhead,
        bubble=idle,
        comm_total=slow.comm,
        optimizer=slow.optimizer,
        stages=tuple(ranks),
    )


def layout_degrees(plan) -> dict[str, int]:
    """The plan's mesh dimensions above 1 (parallel_mode's groups; a pipeline or tensor degree
    ``mixed_parallel`` sets itself), read from the steps' configs."""
    dims: dict[str, int] = {}
    for t in plan.transforms:
        config = t.config()
        for key in ("pipeline", "tensor"):
            if isinstance(config.get(key), int) and config[key] > 1:
                dims.setdefault(key, config[key])
        for group in config.get("groups") or ():
            if isinstance(group, list | tuple) and len(group) == 2 and isinstance(group[1], int) and group[1] > 1:
                dims[str(group[0])] = group[1]
    return dims


def setting_for(plan, hardware: Hardware, world: int, nodes: int) -> Setting:
    """The pricing knobs a composed plan sets: compile, and a pipeline's schedule and degree."""
    schedule, per_rank = "1F1B", 1
    for t in plan.transforms:
        config = t.config()
        if "schedule" in config and config.get("schedule") in schedules.SCHEDULES:
            schedule = config["schedule"]
            per_rank = int(config.get("stages_per_rank") or 1)
    dims = layout_degrees(plan)
    pp = dims.get("pipeline", 1)
    whole = [d for d, n in dims.items() if n == world]
    return Setting(
        hardware=hardware,
        world=world,
        nodes=nodes,
        compiled="compile" in plan.names,
        schedule=schedule,
        pipeline=pp,
        stages_per_rank=per_rank,
        world_dim=whole[0] if whole else "data",
    )

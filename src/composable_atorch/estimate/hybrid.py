"""Hybrid vs flat sharding on paper: per-step communication with two link speeds, and per-rank memory.

The simulated step (:mod:`.simulate`) runs on one fake world with one link speed; what hybrid
sharding (HSDP) changes is *which link* each collective crosses. This module prices that from
declared figures, for every ``zero`` degree that divides the world:

    from composable_atorch.estimate.hybrid import Links, hybrid_table
    rows = hybrid_table(7e9, Environment(world_size=64, nodes=8, device="cuda"), Links(150e9, 25e9))

Model (ring collectives, as torch's NCCL / gloo run them; a ring that spans nodes runs at the
inter-node speed, its slowest hop). Per optimizer step and rank, with ``P`` the parameter bytes,
``G`` the gradient bytes, ``z`` the zero (shard) degree and ``r = world / z`` the replicas:

- all-gather of the parameters inside a zero group: ``(z-1)/z * P``, once in forward and again in
  backward when parameters are resharded after forward (fsdp; zero2 keeps them: once);
- reduce-scatter of the gradients inside the zero group: ``(z-1)/z * G``;
- all-reduce of each rank's gradient shard across the replicas: ``2(r-1)/r * G/z``.

Zero groups are neighbouring ranks (``('zero', z)`` listed first), so a zero group stays inside a
node when ``z`` divides the processes per node; a replica group (stride ``z``) crosses nodes as
soon as the world spans more than one. ``z = world`` is flat fsdp, ``z = 1`` is plain data
parallelism (DDP's all-reduce). Overlap with compute is not modelled (the CPU overlaps none).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from composable_atorch.errors import ConfigError


@dataclass(frozen=True)
class Links:
    """Bytes per second one rank moves over a link inside a node and across nodes (declared figures)."""

    intra_bytes_s: float
    inter_bytes_s: float

    def __post_init__(self):
        for name in ("intra_bytes_s", "inter_bytes_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ConfigError(f"Links.{name}", v, "a positive number of bytes per second")


@dataclass(frozen=True)
class HybridRow:
    """One zero x data split: seconds of communication per step and bytes per rank."""

    zero: int
    data: int
    gather_s: float
    reduce_scatter_s: float
    replica_all_reduce_s: float
    crosses_nodes: str  # which collectives cross the inter-node link
    param_bytes: float
    grad_bytes: float
    optim_bytes: float

    @property
    def comm_s(self) -> float:
        return self.gather_s + self.reduce_scatter_s + self.replica_all_reduce_s

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "comm_s": self.comm_s, "state_bytes": self.state_bytes}


def _spans(group: int, stride: int, per_node: int, nodes: int) -> bool:
    """Whether a group of ``group`` ranks ``stride`` apart (from a rank aligned to it) spans nodes."""
    return nodes > 1 and group > 1 and (group - 1) * stride >= per_node


def hybrid_row(
    param_count: float,
    world: int,
    nodes: int,
    zero: int,
    links: Links,
    *,
    param_dtype_bytes: int = 4,
    grad_dtype_bytes: int = 4,
    optim_bytes_per_param: float = 8.0,
    reshard_after_forward: bool = True,
) -> HybridRow:
    """Price one ``zero`` degree (``zero`` divides ``world``); see the module doc for the model."""
    if world % zero or world % nodes:
        raise ConfigError("hybrid zero degree", zero, f"a divisor of the world size {world} (nodes {nodes} too)")
    per_node, replicas = world // nodes, world // zero
    p, g = param_count * param_dtype_bytes, param_count * grad_dtype_bytes
    zero_cross = _spans(zero, 1, per_node, nodes)
    replica_cross = _spans(replicas, zero, per_node, nodes)
    zero_bw = links.inter_bytes_s if zero_cross else links.intra_bytes_s
    replica_bw = links.inter_bytes_s if replica_cross else links.intra_bytes_s
    gathers = 2 if reshard_after_forward else 1
    shard = (zero - 1) / zero
    crossing = [
        n for n, c in (("zero-group gathers/reduce-scatters", zero_cross), ("replica all-reduce", replica_cross)) if c
    ]
    return HybridRow(
        zero=zero,
        data=replicas,
        gather_s=gathers * shard * p / zero_bw,
        reduce_scatter_s=shard * g / zero_bw,
        replica_all_reduce_s=2 * (replicas - 1) / replicas * (g / zero) / replica_bw,
        crosses_nodes=", ".join(crossing) or "none",
        param_bytes=p / zero if reshard_after_forward else p,
        grad_bytes=g / zero,
        optim_bytes=param_count * optim_bytes_per_param / zero,
    )


def hybrid_table(param_count: float, env, links: Links, **kwargs) -> list[HybridRow]:
    """Every zero x data split of ``env``'s world (``Environment``: world_size, nodes), zero 1 (DDP) to world (flat)."""
    world = env.world_size
    return [
        hybrid_row(param_count, world, env.nodes, z, links, **kwargs) for z in range(1, world + 1) if world % z == 0
    ]


def format_table(rows: list[HybridRow]) -> str:
    """A printable table: one line per split, seconds of communication and GiB per rank."""
    gib = 1024**3
    lines = [f"{'zero':>5} {'data':>5} {'comm s':>9} {'state GiB/rank':>15}  crosses nodes"]
    for r in rows:
        lines.append(f"{r.zero:>5} {r.data:>5} {r.comm_s:>9.4f} {r.state_bytes / gib:>15.3f}  {r.crosses_nodes}")
    return "\n".join(lines)

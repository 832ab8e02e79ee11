"""One collective's seconds on a :class:`~composable_atorch.hardware.Hardware`: NCCL's ring model.

Bytes each rank moves on a ring of ``n`` (nccl-tests' bus-bandwidth convention, ``S`` the full
tensor): all-reduce ``2(n-1)/n S``, all-gather / reduce-scatter ``(n-1)/n S``, a send ``S``. The bus
bandwidth is the link's rate times its collective efficiency (catalog). A group inside one node
runs on the intra-node link. A ring spanning nodes runs one channel through each NIC of a node
(NCCL's rings are rail-aligned: each channel crosses the node boundary at a different GPU's NIC), so
its bus bandwidth is the NICs of the group's ranks on one node together, ``local`` x the network per
device, times the network's efficiency, never above the intra-node link. nccl-tests measures that on
two or three nodes of 8 A100s with 4 x 200 Gb/s HDR each (100 GB/s per node): all-reduce bus
bandwidth 86 GB/s (NVIDIA/nccl-tests#175), 91 GB/s (#100), 85 avg / 96 peak GB/s (#119). A group with
one rank per node (hybrid sharding's replicate dimension) has one NIC. All-to-all's inter-node part
crosses each rank's own NIC (``(n - local)/n S``).

Latency: NCCL's own tuning model (``src/graph/tuning.cc``: a base latency per algorithm and
protocol plus one hop latency per ring step, NVLink / PCIe / network), read from the tables
``torch._inductor.comm_analysis`` carries; the time is the best of the LL (half bandwidth), LL128
(inside a node) and Simple protocols, as NCCL picks.
"""

from __future__ import annotations

import functools

from composable_atorch.hardware import Hardware

#: trace kind -> the catalog's collective curve
CURVE = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all",
    "p2p": "send_recv",
    "p2p_recv": "send_recv",
    "broadcast": "all_gather",  # NCCL's broadcast moves the tensor once per rank, as an all-gather's bus bytes
}
#: protocol -> fraction of the bus bandwidth it reaches (NCCL tuning.cc: LL moves 8-byte flags with
#: each 8 bytes of data, LL128 120 of every 128 bytes)
PROTOCOLS = {"LL": 0.5, "LL128": 120.0 / 128.0, "Simple": 1.0}


@functools.cache
def _latency_tables():
    from torch._inductor.comm_analysis import NCCL_ALGO, NCCL_HW, NCCL_PROTO, baseLat, hwLat

    ring = NCCL_ALGO.RING
    protos = {"LL": NCCL_PROTO.LL, "LL128": NCCL_PROTO.LL128, "Simple": NCCL_PROTO.SIMPLE}
    hw_rows = {"nvlink": NCCL_HW.NVLINK, "xgmi": NCCL_HW.NVLINK, "pcie": NCCL_HW.PCI, "network": NCCL_HW.NET}
    base = {p: baseLat[ring][i] * 1e-6 for p, i in protos.items()}
    hop = {k: {p: hwLat[row][ring][i] * 1e-6 for p, i in protos.items()} for k, row in hw_rows.items()}
    return base, hop


def moved(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends for ``kind`` over ``n`` ranks (bus-bandwidth convention)."""
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind in ("p2p", "p2p_recv", "broadcast"):  # nccl-tests: a broadcast's bus bytes are the tensor's
        return nbytes
    return (n - 1) / n * nbytes


def steps(kind: str, n: int) -> int:
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind in ("p2p", "p2p_recv"):
        return 1
    return n - 1


def collective_s(hw: Hardware, kind: str, nbytes: float, ranks: tuple[int, ...], per_node: int) -> float:
    """Seconds of one collective over ``ranks`` (global ranks; ``per_node`` ranks per node)."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes = len({r // per_node for r in ranks})
    local = max(1, n // nodes)
    curve = CURVE[kind]
    per_rank = moved(kind, nbytes, n)
    intra_bw = hw.intra.bandwidth * hw.intra.collectives[curve](per_rank)
    net_bw = hw.network.bandwidth * hw.network.collectives[curve](per_rank)
    if nodes == 1:
        bus = intra_bw
    elif kind in ("p2p", "p2p_recv"):
        bus = net_bw  # a send between two nodes crosses one NIC
    elif kind == "all_to_all":
        inter = (n - local) / n * nbytes / net_bw
        intra = (local - 1) / n * nbytes / intra_bw
        return _latency(hw, kind, n, nodes, "Simple") + max(inter, intra)
    else:
        bus = min(intra_bw, net_bw * local)  # the ring's channels cross at each local rank's NIC
    best = float("inf")
    for proto, frac in PROTOCOLS.items():
        if proto == "LL128" and nodes > 1:
            continue  # NCCL disables LL128 across InfiniBand nodes
        best = min(best, _latency(hw, kind, n, nodes, proto) + per_rank / (bus * frac))
    return best


def _latency(hw: Hardware, kind: str, n: int, nodes: int, proto: str) -> float:
    """NCCL's ring latency: base + one hop per step (network hops for the steps between nodes)."""
    base, hop = _latency_tables()
    total = steps(kind, n)
    inter = 0 if nodes == 1 else (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1)
    intra_hop = hop[hw.intra.kind][proto]
    if nodes > 1 and proto == "Simple":
        intra_hop = max(intra_hop, 3e-6)  # tuning.cc: a network's overhead on every step of a multi-node ring
    return base[proto] + (total - inter) * intra_hop + inter * hop["network"][proto]

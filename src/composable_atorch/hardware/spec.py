"""What a device is, as data: peak rates, memory, links, and efficiency curves, each figure checked.

A :class:`Hardware` is everything the paper step-time model (``estimate/paper``) reads about an
accelerator: dense peak FLOP/s per dtype, memory capacity and bandwidth, the floor one kernel launch
costs, the link each device has inside its node and the network it has across nodes, and the
fraction of those peaks real kernels and collectives reach (:class:`Efficiency` curves against
problem size). Every figure is validated when the object is made (positive, finite, the right
type), so a bad declaration is a :class:`HardwareError` before any work, never a NaN step time.

Frozen and hashable (mappings are :class:`Table`), so an ``Environment`` can hold one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from composable_atorch.errors import ConfigError

#: dtypes a peak may be given for; "tfloat32" is fp32 GEMMs on tensor cores, "float8" both e4m3 / e5m2
DTYPES = ("float32", "tfloat32", "bfloat16", "float16", "float8")
#: attention kernel curves: ``<kernel>_fwd`` / ``<kernel>_bwd`` (math is priced as its GEMMs plus its scores)
ATTENTION = ("flash_fwd", "flash_bwd", "efficient_fwd", "efficient_bwd")
#: collectives a link has a bus-bandwidth efficiency for
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
#: link kinds (NCCL's latency model has a row for NVLink-class, PCIe and network links)
LINK_KINDS = ("nvlink", "xgmi", "pcie", "network")


class HardwareError(ConfigError):
    """A hardware declaration that cannot be used: a figure that is negative, NaN, infinite or of the
    wrong type, a missing or unknown field, an unknown device name (with the nearest names). Raised
    when the declaration is read, before any estimate runs."""


def number(value: Any, where: str, *, allow_zero: bool = False) -> float:
    """``value`` as a positive finite float (or >= 0 with ``allow_zero``), else HardwareError naming ``where``."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise HardwareError(where, value, "a finite number " + (">= 0" if allow_zero else "> 0"))
    return float(value)


def text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise HardwareError(where, value, "a non-empty string")
    return value


class Table(Mapping):
    """A read-only, hashable mapping (sorted key/value pairs) for the mappings a frozen Hardware holds."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | tuple = ()):
        pairs = items.items() if isinstance(items, Mapping) else items
        object.__setattr__(self, "_items", tuple(sorted(pairs, key=lambda kv: kv[0])))

    def __getitem__(self, key):
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __repr__(self) -> str:
        return f"Table({dict(self._items)!r})"


@dataclass(frozen=True)
class Efficiency:
    """The fraction of a peak reached against problem size: ``(size, fraction)`` points, read
    log-linearly in size between points and flat beyond the ends. ``source``: where the points come
    from (a paper, a microbenchmark, a calibration run)."""

    points: tuple[tuple[float, float], ...]
    source: str

    def __post_init__(self):
        where = "Efficiency.points"
        if isinstance(self.points, str | bytes) or not hasattr(self.points, "__iter__"):
            raise HardwareError(where, self.points, "a list of [size, fraction] pairs")
        pts = []
        for p in self.points:
            if isinstance(p, str | bytes) or not hasattr(p, "__len__") or len(p) != 2:
                raise HardwareError(where, p, "a [size, fraction] pair")
            size, frac = number(p[0], f"{where} size"), number(p[1], f"{where} fraction")
            if frac > 1.5:  # NVLink SHARP all-reduces exceed the link's one-way rate; 1.5 bounds typos
                raise HardwareError(f"{where} fraction", frac, "a fraction of the peak, at most 1.5")
            pts.append((size, frac))
        if not pts:
            raise HardwareError(where, self.points, "at least one [size, fraction] pair")
        object.__setattr__(self, "points", tuple(sorted(pts)))
        text(self.source, "Efficiency.source")

    def __call__(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (x0, f0), (x1, f1) in zip(pts, pts[1:]):
            if size <= x1:
                w = math.log(size / x0) / math.log(x1 / x0)
                return f0 + (f1 - f0) * w
        return pts[-1][1]

    def to_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "source": self.source}


def flat(fraction: float, source: str) -> Efficiency:
    """One fraction at every size."""
    return Efficiency(((1.0, fraction),), source)


@dataclass(frozen=True)
class Link:
    """One device's link: ``bandwidth`` bytes/s in each direction (inside a node: its NVLink / xGMI /
    PCIe share; across nodes: its NIC share), the link kind (NCCL's latency model reads it), and the
    bus-bandwidth fraction each collective reaches on it (:data:`COLLECTIVES`)."""

    bandwidth: float
    kind: str
    collectives: Mapping[str, Efficiency]
    source: str

    def __post_init__(self):
        number(self.bandwidth, "Link.bandwidth")
        if self.kind not in LINK_KINDS:
            raise HardwareError("Link.kind", self.kind, ", ".join(LINK_KINDS))
        text(self.source, "Link.source")
        curves = _table(self.collectives, "Link.collectives", COLLECTIVES, Efficiency, required=COLLECTIVES)
        object.__setattr__(self, "collectives", curves)

    def to_dict(self) -> dict:
        return {
            "bandwidth": self.bandwidth,
            "kind": self.kind,
            "collectives": {k: v.to_dict() for k, v in self.collectives.items()},
            "source": self.source,
        }


def _table(value, where: str, keys: tuple[str, ...], kind: type, required=()) -> Table:
    if not isinstance(value, Mapping):
        raise HardwareError(where, type(value).__name__, f"a mapping with keys among {', '.join(keys)}")
    for k, v in value.items():
        if k not in keys:
            raise HardwareError(f"{where} key", k, ", ".join(keys))
        if kind is float:
            number(v, f"{where}[{k!r}]")
        elif not isinstance(v, kind):
            raise HardwareError(f"{where}[{k!r}]", type(v).__name__, f"a {kind.__name__}")
    missing = [k for k in required if k not in value]
    if missing:
        raise HardwareError(where, sorted(value), f"every one of {', '.join(required)} (missing {', '.join(missing)})")
    return Table({k: (float(v) if kind is float else v) for k, v in value.items()})


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the system it sits in (see the module doc). ``sources`` names where
    each figure comes from (key: the field, ``peak_flops.bfloat16``, ``gemm.bfloat16``, ...)."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    launch_s: float
    intra: Link
    network: Link
    gemm: Mapping[str, Efficiency]
    attention: Mapping[str, Efficiency]
    memory: Efficiency
    devices_per_node: int = 8
    compute_capability: tuple[int, int] | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        set_ = object.__setattr__
        text(self.name, "Hardware.name")
        set_(self, "peak_flops", _table(self.peak_flops, "Hardware.peak_flops", DTYPES, float, ("bfloat16",)))
        for name in ("memory_bytes", "memory_bandwidth", "launch_s"):
            number(getattr(self, name), f"Hardware.{name}", allow_zero=name == "launch_s")
        for name in ("intra", "network"):
            if not isinstance(getattr(self, name), Link):
                raise HardwareError(f"Hardware.{name}", type(getattr(self, name)).__name__, "a Link")
        set_(self, "gemm", _table(self.gemm, "Hardware.gemm", DTYPES, Efficiency, ("bfloat16",)))
        set_(self, "attention", _table(self.attention, "Hardware.attention", ATTENTION, Efficiency, ATTENTION))
        if not isinstance(self.memory, Efficiency):
            raise HardwareError("Hardware.memory", type(self.memory).__name__, "an Efficiency")
        n = self.devices_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise HardwareError("Hardware.devices_per_node", n, "an integer >= 1")
        cc = self.compute_capability
        if cc is not None:
            if isinstance(cc, str | bytes) or len(cc) != 2 or not all(isinstance(v, int) and v >= 0 for v in cc):
                raise HardwareError("Hardware.compute_capability", cc, "None or (major, minor) non-negative ints")
            set_(self, "compute_capability", tuple(cc))
        if not isinstance(self.sources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()
        ):
            raise HardwareError("Hardware.sources", self.sources, "a mapping of figure name -> source text")
        set_(self, "sources", Table(self.sources))

    # -- reading ---------------------------------------------------------------------------------
    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of ``dtype``; a dtype the device has no rate for runs at the nearest it has
        (fp8 without fp8 units at the bf16 rate, fp16 at bf16, tf32 at fp32)."""
        for d in _FALLBACK.get(dtype, (dtype,)):
            if d in self.peak_flops:
                return self.peak_flops[d]
        return self.peak_flops["bfloat16"]

    def gemm_efficiency(self, dtype: str, flops: float) -> float:
        for d in _FALLBACK.get(dtype, (dtype,)):
            if d in self.gemm:
                return self.gemm[d](flops)
        return self.gemm["bfloat16"](flops)

    def source(self, figure: str) -> str:
        return self.sources.get(figure, "declared")

    def figures(self) -> dict[str, float]:
        """Every scalar figure by name (for checks and reports)."""
        out = {f"peak_flops.{k}": v for k, v in self.peak_flops.items()}
        out.update(memory_bytes=self.memory_bytes, memory_bandwidth=self.memory_bandwidth, launch_s=self.launch_s)
        out.update({"intra.bandwidth": self.intra.bandwidth, "network.bandwidth": self.network.bandwidth})
        return out

    def with_network(self, bandwidth: float, source: str) -> Hardware:
        """The same device on another network (bytes/s per device and direction), e.g. a table's
        "800 Gb/s RDMA per node of 8": ``with_network(800e9 / 8 / 8, "...")``."""
        return replace(self, network=replace(self.network, bandwidth=bandwidth, source=source))

    def replace(self, **changes) -> Hardware:
        """A copy with some fields changed (checked again)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise HardwareError("Hardware field", unknown[0], ", ".join(f.name for f in fields(self)))
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "launch_s": self.launch_s,
            "intra": self.intra.to_dict(),
            "network": self.network.to_dict(),
            "gemm": {k: v.to_dict() for k, v in self.gemm.items()},
            "attention": {k: v.to_dict() for k, v in self.attention.items()},
            "memory": self.memory.to_dict(),
            "devices_per_node": self.devices_per_node,
            "compute_capability": None if self.compute_capability is None else list(self.compute_capability),
            "sources": dict(self.sources),
        }


#: the rate a dtype runs at where the device lists none for it
_FALLBACK = {
    "float8": ("float8", "bfloat16"),
    "float16": ("float16", "bfloat16"),
    "bfloat16": ("bfloat16",),
    "tfloat32": ("tfloat32", "float32"),
    "float32": ("float32", "tfloat32"),
}

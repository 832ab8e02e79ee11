"""What an estimate returns: per-rank bytes by kind, the peak, and a step time where one can be had.

Plain data (no torch objects), so the search can store it next to a trial and compare it with
what the trial measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FIELDS = ("parameters", "gradients", "optimizer", "activations", "temporary")


@dataclass(frozen=True)
class RankCost:
    """Bytes one rank holds at its memory peak, split by kind (torch MemTracker's categories).

    ``parameters`` includes buffers; ``temporary`` holds all-gather / reduce-scatter buffers and
    other short-lived tensors, plus DDP's gradient buckets (which the estimate adds from the
    contract, see ``core.contract.Cost``). ``peak`` is the sum at the peak moment, not the sum of
    each kind's own maximum.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    peak: int
    #: which pipeline stage this rank holds (None without a pipeline)
    stage: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def human(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True)
class Estimate:
    """Per-rank cost of one plan, predicted without running anything real."""

    ranks: list[RankCost]
    world_size: int
    device: str
    #: the plan's steps as simulated (names), and what the simulation left out or assumed
    steps: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: seconds per optimizer step, or None where no estimator applies (see ``step_time_mode``)
    step_time_s: float | None = None
    #: how ``step_time_s`` was made (a torch RuntimeEstimator mode), or None
    step_time_mode: str | None = None
    #: floating-point operations of one optimizer step on one rank (torch's FlopCounterMode)
    flops: int | None = None
    #: per-rank micro-batch and micro-batches per step the plan leaves each rank
    micro_batch: int | None = None
    micro_batches: int = 1
    #: the modelled step time's parts (``steptime.StepTime``: compute / comm / overhead / bubble), where modelled
    step_time: Any = None
    method: str = "torch MemTracker peak over one simulated step (FakeTensorMode, fake process group)"
    extra: dict = field(default_factory=dict)
    #: the device the step was priced on (a catalog or declared name), the nodes the world spans, and
    #: that device's memory (what ``fits`` checks against when no limit is given)
    hardware: str | None = None
    nodes: int = 1
    device_memory: int | None = None
    #: throughput of the priced step (``estimate.paper.Utilization``: tokens/s, TFLOP/s, MFU, HFU per device)
    utilization: Any = None

    @property
    def tokens_per_s_per_device(self) -> float | None:
        return None if self.utilization is None else self.utilization.tokens_per_s_per_device

    @property
    def tflops_per_device(self) -> float | None:
        return None if self.utilization is None else self.utilization.tflops_per_device

    @property
    def mfu(self) -> float | None:
        return None if self.utilization is None else self.utilization.mfu

    @property
    def hfu(self) -> float | None:
        return None if self.utilization is None else self.utilization.hfu

    @property
    def peak(self) -> int:
        """The largest peak over ranks (what must fit on every device)."""
        return max(r.peak for r in self.ranks)

    def fits(self, limit_bytes: int | float | str | None = None, margin: float = 0.1) -> bool | None:
        """True when the peak plus ``margin`` (a fraction, default 10%) stays within ``limit_bytes``
        (a number or a string such as "80GiB"; default the priced device's memory, None when there is none)."""
        from composable_atorch.units import parse_bytes

        if limit_bytes is None:
            if self.device_memory is None:
                return None
            limit_bytes = self.device_memory
        return self.peak * (1.0 + margin) <= parse_bytes(limit_bytes, "limit_bytes", required=True)

    def distinct_ranks(self) -> list[tuple[list[int], RankCost]]:
        """Ranks grouped by equal cost (one row per group in the table)."""
        groups: list[tuple[list[int], RankCost]] = []
        for i, r in enumerate(self.ranks):
            for ids, cost in groups:
                if cost == r:
                    ids.append(i)
                    break
            else:
                groups.append(([i], r))
        return groups

    def table(self) -> str:
        head = ("ranks",) + FIELDS + ("peak",)
        rows = []
        for ids, r in self.distinct_ranks():
            label = (
                f"{ids[0]}"
                if len(ids) == 1
                else f"{ids[0]}-{ids[-1]}"
                if ids == list(range(ids[0], ids[-1] + 1))
                else ",".join(map(str, ids))
            )
            if r.stage is not None:
                label += f" (stage {r.stage})"
            rows.append((label,) + tuple(human(getattr(r, f)) for f in FIELDS) + (human(r.peak),))
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
        ]
        step = "step time: " + (
            f"{self.step_time_s:.4f} s ({self.step_time_mode})"
            if self.step_time_s is not None
            else f"not estimated ({self.extra.get('step_time_reason', 'no estimator for this device')})"
        )
        lines.append(f"peak per rank (max): {human(self.peak)}; world {self.world_size}, device {self.device}; {step}")
        if self.utilization is not None:
            u = self.utilization
            on = f"{self.hardware} x {self.world_size}" + (f" ({self.nodes} nodes)" if self.nodes > 1 else "")
            lines.append(
                f"on {on}: {u.tokens_per_s_per_device:,.0f} tokens/s per device, {u.tflops_per_device:.1f} model "
                f"TFLOP/s per device, MFU {u.mfu:.1%}, HFU {u.hfu:.1%} (of the {u.peak_dtype} peak "
                f"{u.peak_flops / 1e12:.0f} TFLOP/s); fits in {human(self.device_memory)}: "
                f"{'yes' if self.fits() else 'NO'}"
            )
        if self.flops is not None:
            lines.append(
                f"flops per step per rank: {self.flops:.3e}; micro-batch {self.micro_batch} x {self.micro_batches}"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "device": self.device,
            "peak": self.peak,
            "ranks": [r.to_dict() for r in self.ranks],
            "steps": list(self.steps),
            "notes": list(self.notes),
            "step_time_s": self.step_time_s,
            "step_time_mode": self.step_time_mode,
            "step_time": None if self.step_time is None else self.step_time.to_dict(),
            "flops": self.flops,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "method": self.method,
            "hardware": self.hardware,
            "nodes": self.nodes,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_bytes": self.peak,
            "fits": self.fits(),
            **({"extra": self.extra} if self.extra else {}),
        }

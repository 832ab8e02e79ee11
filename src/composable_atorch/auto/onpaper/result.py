"""What the search on paper found: the plans that fit, ranked by predicted tokens/s per device, what
became of the rest of the space, and the pick as a plan file that runs unchanged on the cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.auto.onpaper.axes import label_plan
from composable_atorch.auto.onpaper.price import Priced
from composable_atorch.core.plan import Plan
from composable_atorch.environment import Environment


@dataclass
class PaperResult:
    """``ranking``: the priced plans that fit (peak x (1 + margin) within ``memory_limit``), fastest
    first; ``priced``: every plan the estimate was asked for; ``counts``: the space's points by what
    became of them (priced, a rule that spared the estimate, refused, not on the walk's path);
    ``notes``: what the transforms did not offer and why, and what was assumed."""

    env: Environment
    memory_limit: int
    margin: float
    ranking: list[Priced]
    priced: list[Priced]
    counts: dict[str, int]
    space_size: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    axes: str = ""
    failures: dict[str, str] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Priced | None:
        return self.ranking[0] if self.ranking else None

    @property
    def best_plan(self) -> Plan | None:
        return self.best.plan if self.best is not None else None

    def write_best(self, path: str | os.PathLike) -> str | None:
        """The pick as plan JSON (``strategy.dump``): load it with ``strategy.load(path, env=...)`` on the
        cluster. None (nothing written) when no plan fits."""
        from composable_atorch import strategy

        if self.best_plan is None:
            return None
        strategy.dump(self.best_plan, path)
        return os.fspath(path)

    # -- printing ------------------------------------------------------------------------------
    def table(self, top: int = 10):
        """The ranking's first ``top`` rows as a rich Table."""
        from rich.table import Table

        hw = self.env.hardware.name if self.env.hardware is not None else "?"
        where = f"{self.env.world_size} x {hw} ({self.env.nodes} nodes)"
        table = Table(title=f"plans for {where}, ranked by predicted tokens/s per device")
        for name, justify in (
            ("#", "right"),
            ("plan", "left"),
            ("micro-batch", "right"),
            ("peak GiB", "right"),
            ("step s", "right"),
            ("tokens/s/dev", "right"),
            ("TFLOP/s", "right"),
            ("MFU", "right"),
            ("HFU", "right"),
        ):
            table.add_column(name, justify=justify)
        for i, p in enumerate(self.ranking[:top], 1):
            table.add_row(
                str(i),
                label_plan(p.plan),
                f"{p.micro_batch} x {p.micro_batches}" if p.micro_batch is not None else "-",
                f"{p.peak_bytes / 2**30:.1f}",
                f"{p.step_time_s:.3f}",
                f"{p.tokens_per_s_per_device:,.0f}",
                f"{p.tflops_per_device:.0f}",
                f"{p.mfu:.1%}",
                f"{p.hfu:.1%}",
            )
        return table

    def summary(self) -> list[str]:
        """The lines under the table: the space, what became of it, the notes."""
        lines = [
            f"space: {self.space_size:,} points; {len(self.priced)} priced in {self.seconds:.0f} s; "
            f"{len(self.ranking)} fit {self.memory_limit / 2**30:.1f} GiB with a {self.margin:.0%} margin",
        ]
        lines += [f"  {n:>9,}  {reason}" for reason, n in sorted(self.counts.items(), key=lambda kv: -kv[1])]
        lines += [f"  the estimate failed for {axis}: {why[:200]}" for axis, why in self.failures.items()]
        lines += [f"note: {n}" for n in self.notes]
        return lines

    def print(self, console=None, top: int = 10) -> None:
        from rich.console import Console

        console = console or Console()
        console.print(self.table(top))
        for line in self.summary():
            console.print(line, highlight=False, markup=False)

    def to_dict(self, top: int | None = None) -> dict:
        rows = []
        for i, p in enumerate(self.ranking[:top] if top else self.ranking, 1):
            rows.append(
                {
                    "rank": i,
                    "plan": label_plan(p.plan),
                    "steps": list(p.plan.names),
                    "step_time_s": p.step_time_s,
                    "tokens_per_s_per_device": p.tokens_per_s_per_device,
                    "tflops_per_device": p.tflops_per_device,
                    "mfu": p.mfu,
                    "hfu": p.hfu,
                    "peak_bytes": p.peak_bytes,
                    "fits": p.fits,
                    "micro_batch": p.micro_batch,
                    "micro_batches": p.micro_batches,
                    "split_s": p.extra.get("split", {}),
                    "plan_json": p.plan.to_dict(),
                }
            )
        hw = self.env.hardware
        return {
            "hardware": None if hw is None else hw.name,
            "world_size": self.env.world_size,
            "nodes": self.env.nodes,
            **self.workload,
            "memory_limit_bytes": self.memory_limit,
            "margin": self.margin,
            "seconds": self.seconds,
            "space_size": self.space_size,
            "priced": len(self.priced),
            "ranking": rows,
            "dropped": self.counts,
            "estimate_failures": self.failures,
            "notes": self.notes,
        }

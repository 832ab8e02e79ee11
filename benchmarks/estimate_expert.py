"""estimate's per-rank peak under expert_parallel against the measured per-rank peak, and the
per-rank memory of the MoE families with and without expert parallelism.

World 2 on gloo, the transformers-5 MoE families of tests/zoo/moe.py (4 experts, top-2, AdamW),
a global batch of 4 x 16 tokens: ddp (every rank holds every expert) and expert 2 (each rank half of
the experts; tokens dispatched by all-to-all). Measured: torch's MemTracker over one step after two
warm-up steps on each rank (auto.worker.peak_bytes_of_step, as the trial worker measures); the
estimate simulates the dispatch with a balanced router (fake tensors carry no routing values).
Writes benchmarks/results/estimate_expert.json and prints a table.

    PYTHONPATH=src python benchmarks/estimate_expert.py
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "tests", "estimate")]

import test_estimate_expert as ep  # noqa: E402

import composable_atorch as ca  # noqa: E402

from _dist import run_world  # noqa: E402


def _measure_ddp(rank, world):
    """Every family under ddp at world 2 (each rank half of the global batch, every expert)."""
    plan = ca.compose(ca.ddp(), env=ep.ENV2)
    return {name: ep.measured_peak(name, plan, ep.half(rank)) for name in ep.FAMILIES}


def main():
    split = run_world(ep._measure, 2, timeout=900)
    whole = run_world(_measure_ddp, 2, timeout=900)
    rows = []
    print(f"{'family':12s} {'plan':9s} {'rank 0':>9s} {'rank 1':>9s} {'estimate':>9s} {'ratio':>6s}")
    for name in ep.FAMILIES:
        for label, measured, plan in (
            ("ddp", whole, ca.compose(ca.ddp(), env=ep.ENV2)),
            ("expert 2", split, ep._plan()),
        ):
            peaks = [m[name] for m in measured]
            est = ep.predict(name, plan, 2)
            ratio = est / max(peaks)
            rows.append({"family": name, "plan": label, "measured": peaks, "estimate": est, "ratio": ratio})
            print(f"{name:12s} {label:9s} {peaks[0]:9d} {peaks[1]:9d} {est:9d} {ratio:6.3f}", flush=True)
    out = os.path.join(HERE, "results", "estimate_expert.json")
    with open(out, "w") as f:
        json.dump({"world": 2, "device": "cpu", "batch": [ep.BATCH, 16], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Hybrid (zero 2 x data 2) vs flat sharding at world 4 on localhost: measured step, the estimator's
prediction, and the on-paper table with two link speeds.

    python benchmarks/hybrid.py [--steps 5] [--small]

1. Measured: the user GPT (benchmarks/_usergpt.py) trains ``--steps`` timed AdamW steps (after 2
   warm-up steps) under flat fsdp, hybrid fsdp, flat zero2, hybrid zero2 and ddp on a gloo group of
   4 spawned processes; the median step and a 16 MiB all-reduce's bus bandwidth are reported.
2. Predicted: ``estimate(plan, ...).step_time`` for the same plans (the simulated step's collectives
   priced at their own group sizes), and :mod:`composable_atorch.estimate.hybrid`'s communication
   for zero 1 / 2 / 4 with the measured localhost bandwidth as both links (one machine: no slow link).
3. On paper: a 7B-parameter model at world 64 on 8 nodes with declared figures (150 GB/s inside a
   node, 25 GB/s across), every zero degree, communication seconds and per-rank state.

Writes benchmarks/results/hybrid.json. No target: the numbers are for reading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

RESULTS = HERE / "results" / "hybrid.json"
PLANS = {
    "fsdp flat (data 4)": ([("data", 4)], "fsdp"),
    "fsdp hybrid (zero 2 x data 2)": ([("zero", 2), ("data", 2)], "fsdp"),
    "zero2 flat (data 4)": ([("data", 4)], "zero2"),
    "zero2 hybrid (zero 2 x data 2)": ([("zero", 2), ("data", 2)], "zero2"),
    "ddp (data 4)": ([("data", 4)], "ddp"),
}


def plan_of(groups, kind: str, env=None):
    from _usergpt import Block

    import composable_atorch as ca

    engine = {"fsdp": ca.fsdp(wrap=(Block,)), "zero2": ca.zero2(wrap=(Block,)), "ddp": ca.ddp()}[kind]
    return ca.compose(ca.parallel_mode(groups), engine, env=env)


def build(small: bool):
    import _usergpt as u

    return u.UserGPT(**u.SMALL) if small else u.UserGPT()


def measure(rank: int, world: int, steps: int, small: bool) -> dict:
    import _usergpt as u
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    out = {}
    buf = torch.ones(4 * 1024 * 1024)  # 16 MiB
    for _ in range(2):
        dist.all_reduce(buf)
    t = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(buf)
    sec = (time.perf_counter() - t) / 5
    out["allreduce_bus_bytes_s"] = 2 * (world - 1) / world * buf.numel() * 4 / sec
    seq = u.SMALL["seq"] if small else u.SEQ
    for label, (groups, kind) in PLANS.items():
        torch.manual_seed(0)
        model = build(small)
        loader = DataLoader(u.Tokens(seq=seq), batch_size=u.GLOBAL_BATCH)
        m, opt, data = plan_of(groups, kind)(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
        times, it = [], iter(data)
        for i in range(steps + 2):
            tokens, targets = next(it)
            dist.barrier()
            t = time.perf_counter()
            loss = u.criterion(m(tokens), targets)
            opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
            opt.step()
            opt.zero_grad()
            if i >= 2:
                times.append(time.perf_counter() - t)
        out[label] = statistics.median(times)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)

    import _usergpt as u

    from composable_atorch.environment import Environment
    from composable_atorch.estimate import estimate
    from composable_atorch.estimate.hybrid import Links, format_table, hybrid_table

    from _dist import run_world

    ranks = run_world(measure, 4, args.steps, args.small, timeout=3600)
    measured = {k: max(r[k] for r in ranks) for k in PLANS}  # the slowest rank sets the step
    bw = min(r["allreduce_bus_bytes_s"] for r in ranks)
    seq = u.SMALL["seq"] if args.small else u.SEQ
    env4 = Environment(world_size=4)
    predicted = {}
    for label, (groups, kind) in PLANS.items():
        est = estimate(
            plan_of(groups, kind, env4),
            lambda: build(args.small),
            (torch.Size([u.GLOBAL_BATCH, seq]), torch.Size([u.GLOBAL_BATCH, seq])),
            world_size=4,
            device="cpu",
            criterion=u.criterion,
        )
        predicted[label] = est.step_time.to_dict() if est.step_time else None
    n_params = sum(p.numel() for p in build(args.small).parameters())
    local = hybrid_table(n_params, Environment(world_size=4, nodes=2), Links(bw, bw))
    paper_env = Environment(world_size=64, nodes=8, device="cuda")
    paper = hybrid_table(7e9, paper_env, Links(150e9, 25e9), param_dtype_bytes=2, grad_dtype_bytes=2)

    print(f"world 4 on localhost, {n_params / 1e6:.1f}M parameters; all-reduce bus bandwidth {bw / 1e9:.2f} GB/s")
    print(f"{'plan':34} {'measured s':>11} {'predicted s':>12} {'pred. comm s':>13}")
    for label in PLANS:
        p = predicted[label] or {}
        print(
            f"{label:34} {measured[label]:>11.4f} {p.get('seconds', float('nan')):>12.4f} "
            f"{p.get('comm', float('nan')):>13.4f}"
        )
    print("\non paper at localhost's bandwidth (both links equal), fsdp, per step:")
    print(format_table(local))
    print(
        f"\non paper: 7B parameters (bf16 params and grads, fp32 AdamW), {paper_env.describe()}, "
        "150 GB/s in a node, 25 GB/s across:"
    )
    print(format_table(paper))
    result = {
        "parameters": n_params,
        "allreduce_bus_bytes_s": bw,
        "measured_step_s": measured,
        "predicted_step": predicted,
        "paper_localhost": [r.to_dict() for r in local],
        "paper_7b_64_ranks_8_nodes": [r.to_dict() for r in paper],
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""Per-rank peak memory and step time of context parallelism against sequence length.

    python benchmarks/context.py [--seqs 256 512 1024] [--steps 3]

One global batch of 2 sequences (too few to split over more data ranks: the case context
parallelism is for), trained on a user model calling scaled_dot_product_attention (tests/_seq.py's
``UserLM``, d_model 64, 4 heads, 2 layers), fp32 AdamW, on gloo: one process (context 1), context 2
at world 2, context 4 and context 2 x data 2 at world 4; context 2 and 4 also with
``rotation="ring"`` (keys/values passed around the group; "ring" in the layout column).
``measured``: torch MemTracker's peak over one step after a warm-up step (the trial worker's
``peak_bytes_of_step``), the largest over the ranks; ``step s``: median seconds of ``--steps``
steps on rank 0 (2 shared CPU cores: rough).
``predicted``: ``estimate_plan`` for the same plan (fake process group; collectives priced at zero).
Writes benchmarks/results/context.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
RESULTS = HERE / "results" / "context.json"
BATCH = 2
C2, C4 = (("context", 2),), (("context", 4),)
LAYOUTS = {
    1: [((), "allgather")],
    2: [(C2, "allgather"), (C2, "ring")],
    4: [(C4, "allgather"), (C4, "ring"), ((("context", 2), ("data", 2)), "allgather")],
}


def _plan(groups, rotation="allgather"):
    import composable_atorch as ca

    if not groups:
        return ca.compose()
    return ca.compose(ca.parallel_mode(list(groups)), ca.context_parallel(rotation=rotation))


def _model(seq):
    import _seq

    return _seq.user_lm(max_len=seq, d=64)


def measure(rank, world, seqs, steps):
    import torch
    from torch.utils.data import DataLoader

    import _seq
    from composable_atorch import train_step
    from composable_atorch.auto.worker import peak_bytes_of_step
    from composable_atorch.data import TextDataset

    torch.set_num_threads(1)
    rows = []
    for groups, rotation in LAYOUTS[world]:
        for seq in seqs:
            model = _model(seq)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loader = DataLoader(TextDataset(seq, limit=BATCH * (steps + 2)), batch_size=BATCH)
            model, optim, loader = _plan(groups, rotation)(model, optim, loader)
            batches = iter(list(loader))

            def step(before_micro=None, model=model, optim=optim, batches=batches):
                x, y = next(batches)
                return train_step(model, optim, x, y, _seq.seq_loss)

            step()  # warm-up
            peak, _ = peak_bytes_of_step(step, model, optim, "cpu")
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            rows.append(
                {"groups": groups, "rotation": rotation, "seq": seq, "peak": peak, "step_s": statistics.median(times)}
            )
    return rows


def _spawned(rank, world, init, seqs, steps, out):
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        rows = measure(rank, world, seqs, steps)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def run_world(world, seqs, steps):
    if world == 1:
        return [measure(0, 1, seqs, steps)]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(_spawned, args=(world, os.path.join(tmp, "init"), seqs, steps, out), nprocs=world)
        return [json.load(open(f"{out}.{r}")) for r in range(world)]


def predicted(groups, seq, world, rotation="allgather"):
    import torch

    import _seq
    from composable_atorch import Environment, compose, context_parallel, parallel_mode
    from composable_atorch.estimate.core import estimate

    plan = (
        compose(parallel_mode(list(groups)), context_parallel(rotation=rotation), env=Environment(world_size=world))
        if groups
        else (compose(env=Environment(world_size=1)))
    )
    shapes = (torch.Size([BATCH, seq]), torch.Size([BATCH, seq]))
    result = estimate(
        plan, lambda: _model(seq), shapes, world_size=world, device="cpu", step_time=False, criterion=_seq.seq_loss
    )
    return max(r.peak for r in result.ranks)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    table = []
    for world in sorted(LAYOUTS):
        per_rank = run_world(world, args.seqs, args.steps)
        for i, row in enumerate(per_rank[0]):
            peak = max(rows[i]["peak"] for rows in per_rank)
            groups = tuple(tuple(g) for g in row["groups"])
            try:
                pred = predicted(groups, row["seq"], world, row["rotation"])
            except Exception as exc:  # noqa: BLE001 - the estimator's fake group may not run the ring's p2p
                print(f"no prediction for {groups} {row['rotation']}: {type(exc).__name__}: {exc}"[:200])
                pred = None
            label = " x ".join(f"{n} {s}" for n, s in groups) or "one process"
            label += " ring" if row["rotation"] == "ring" else ""
            table.append(
                {
                    "world": world,
                    "layout": label,
                    "seq": row["seq"],
                    "measured_mib": peak / 2**20,
                    "predicted_mib": None if pred is None else pred / 2**20,
                    "error": None if pred is None else (pred - peak) / peak,
                    "step_s": row["step_s"],
                }
            )
    print(
        f"{'world':>5} {'layout':<22} {'seq':>5} {'measured MiB':>13} {'predicted MiB':>14} {'error':>7} {'step s':>7}"
    )
    for r in sorted(table, key=lambda r: (r["seq"], r["world"], r["layout"])):
        pred = "-" if r["predicted_mib"] is None else f"{r['predicted_mib']:.2f}"
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        print(
            f"{r['world']:>5} {r['layout']:<22} {r['seq']:>5} {r['measured_mib']:>13.2f} {pred:>14} "
            f"{err:>7} {r['step_s']:>7.3f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

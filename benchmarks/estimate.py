"""Predicted vs measured peak memory per rank, for every plan of the demo's search space at world 2.

    python benchmarks/estimate.py                 # all plans (~30 min here)
    python benchmarks/estimate.py --limit 12      # the first 12 plans
    python benchmarks/estimate.py --match ddp     # the plans whose label contains "ddp"
    python benchmarks/estimate.py --world 4 --model-parallel   # the tensor / pipeline / mixed layouts, per stage

Measured: groups of spawned processes (gloo, 16 plans per group) measure every plan in turn, as a
trial does (``auto.worker``): build the workload (``cli.demo.TASK``), apply the plan, two warm-up
steps, then ``worker.peak_bytes_of_step`` (torch MemTracker over one step), each step through
``train_step`` with the workload's ``criterion`` (as the worker trains this workload; a pipeline
plan trains no other way). Predicted: ``composable_atorch.estimate_plan(plan, TASK.model, batch shapes,
world_size=..., device="cpu", criterion=...)`` in this process — meta model, fake tensors, fake
process group; nothing real allocated. One row per (plan, stage): the measured peak is the largest
over the ranks holding that stage (all ranks without a pipeline).

Target (issue 12): median |error| <= 5 %, worst <= 10 %. Prints the table (plan, predicted,
measured, error) and writes benchmarks/results/estimate.json (``--match``/``--limit`` runs write
estimate_<match>.json). ``measured`` is the trial worker's own measurement: the step's batches
fetched before the tracker starts (``worker.prefetch``; fetched inside, the loader's batch is a
new view of the dataset's whole corpus tensor, ~3.7 MB, which MemTracker counted as activation).

``--model-parallel``: only the plans with model parallelism (``mixed_parallel``'s tensor x
pipeline x data layouts, the search's only way to propose them, see ``MixedParallel.candidates``),
use with ``--world 4``. Writes benchmarks/results/estimate_model_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

RESULTS = Path(__file__).parent / "results" / "estimate.json"
MODEL_PARALLEL_RESULTS = RESULTS.with_name("estimate_model_parallel.json")
#: the transforms that make a plan model-parallel (the search proposes them through mixed_parallel)
MODEL_PARALLEL = ("mixed_parallel", "tensor_parallel", "pipeline_parallel")
MEDIAN_TARGET, WORST_TARGET = 0.05, 0.10
#: plans measured per spawned group, and how long one group may take
CHUNK, CHUNK_TIMEOUT_S = 16, 900.0


def demo_plans(world: int = 2) -> list[tuple[str, str]]:
    """(label, plan JSON) for every valid plan of the demo's search space at ``world``."""
    from composable_atorch.auto.space import SearchSpace
    from composable_atorch.cli.demo import DEMO_EXCLUDED, TASK
    from composable_atorch.environment import Environment

    env = Environment.detect().with_(world_size=world)
    space = SearchSpace.for_model(
        TASK.model(), world_size=world, batch_size=TASK.batch_size, env=env, excluded=DEMO_EXCLUDED
    )
    out = []
    for point in space.enumerate().valid.values():
        out.append((" | ".join(t.describe() for t in point.plan.transforms), point.plan.to_json()))
    return out


def measure_plans(
    rank: int, world: int, plan_jsons: list[str], warmup: int = 2, with_criterion: bool = False
) -> list[dict]:
    """In each rank of a real group: the trial's peak measurement for every plan, in turn.
    ``with_criterion``: train through ``train_step`` with the workload's criterion, as the trial
    worker does for a workload that has one (a pipeline plan trains no other way)."""
    import torch

    from composable_atorch.auto.worker import batches, peak_bytes_of_step, prefetch, trial_step
    from composable_atorch.cli.demo import TASK
    from composable_atorch.core.plan import Plan
    from composable_atorch.runtime.train_step import runner_of

    criterion = TASK.workload().criterion if with_criterion else None
    out = []
    for text in plan_jsons:
        try:
            model, optim, loader = TASK.workload().build()
            model, optim, loader = Plan.from_json(text)(model, optim, loader)
            data = batches(loader)
            for _ in range(warmup):
                trial_step(model, optim, data, TASK.loss, "cpu", criterion=criterion)

            fetched = prefetch(optim, data, "cpu")  # as the worker does

            def step(before_micro=None, model=model, optim=optim, fetched=fetched):
                return trial_step(model, optim, iter(fetched), TASK.loss, "cpu", before_micro, criterion=criterion)

            peak, _ = peak_bytes_of_step(step, model, optim, "cpu")
            runner = runner_of(optim)
            out.append({"peak": peak, "stages": None if runner is None else list(runner.local)})
        except Exception as exc:  # noqa: BLE001 - a plan that fails is reported, not fatal
            out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
        del model, optim, loader
        torch.distributed.barrier()
    return out


def measure_in_chunks(
    plan_jsons: list[str], world: int, with_criterion: bool, chunk: int = CHUNK, timeout: float = CHUNK_TIMEOUT_S
) -> list[list[dict]]:
    """``measure_plans`` over ``chunk`` plans per freshly spawned group (per rank: one result per plan).

    Why chunks: every plan's device mesh makes gloo groups that live as long as the processes
    (~1,200 threads per rank after a few hundred plans, most of them polling, slowing every later
    plan several-fold), and destroying them by hand left torch's cached meshes pointing at dead
    groups. A chunk that does not finish within ``timeout`` (a plan failing on some ranks while the
    others wait in a collective) is recorded as a measurement error for each of its plans."""
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    for start in range(0, len(plan_jsons), chunk):
        part = plan_jsons[start : start + chunk]
        try:
            got = run_world(measure_plans, world, part, 2, with_criterion, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a chunk that hangs or dies is reported, not fatal
            why = f"chunk of {len(part)} plans failed: {type(exc).__name__}: {exc}"[:300]
            got = [[{"error": why} for _ in part] for _ in range(world)]
        for rank in range(world):
            per_rank[rank].extend(got[rank])
        print(f"  measured {min(start + chunk, len(plan_jsons))}/{len(plan_jsons)} plans", flush=True)
    return per_rank


def predict(plan_json: str, world: int = 2, with_criterion: bool = False) -> dict:
    import torch

    from composable_atorch.cli.demo import TASK
    from composable_atorch.estimate import estimate

    shape = torch.Size([TASK.batch_size, TASK.seq_len])
    criterion = TASK.workload().criterion if with_criterion else None
    est = estimate(
        plan_json,
        TASK.model,
        (shape, shape),
        world_size=world,
        device="cpu",
        loss_fn=TASK.loss,
        optimizer=TASK.optimizer,
        criterion=criterion,
    )
    return {"peak": est.peak, "rank0": est.ranks[0].to_dict(), "ranks": [r.to_dict() for r in est.ranks]}


def run_world(fn, world, *args, timeout=3600.0):
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from _dist import run_world as _run

    return _run(fn, world, *args, timeout=timeout)


def summarize(rows: list[dict], key: str = "error") -> dict:
    errors = [abs(r[key]) for r in rows if r.get(key) is not None]
    failed = sum(1 for r in rows if r.get(key) is None)
    if not errors:
        return {"plans": 0, "not_compared": failed}
    return {
        "plans": len(errors),
        "not_compared": failed,
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": max(errors),
        "median_pass": statistics.median(errors) <= MEDIAN_TARGET,
        "worst_pass": max(errors) <= WORST_TARGET,
    }


def stage_rows(label: str, pred: dict | None, per_rank: list[dict], predict_error: str | None = None) -> list[dict]:
    """One row per (plan, stage): the prediction for that stage, the largest measured peak over the ranks
    holding it (all ranks are one group without a pipeline). Per-rank values are kept in the row."""
    if any("error" in m for m in per_rank) or pred is None:
        row = {"plan": label, "ranks": list(range(len(per_rank)))}
        if pred is None:
            row["predict_error"] = predict_error
        if any("error" in m for m in per_rank):
            row["measure_error"] = next(m["error"] for m in per_rank if "error" in m)
        return [row]
    groups: dict = {}
    for rank, cost in enumerate(pred["ranks"]):
        groups.setdefault(cost["stage"], []).append(rank)
    rows = []
    for stage, ranks in groups.items():
        measured = [per_rank[r]["peak"] for r in ranks]
        held = {tuple(per_rank[r]["stages"] or ()) for r in ranks}
        predicted = pred["ranks"][ranks[0]]["peak"]
        row = {
            "plan": label,
            "stage": stage,
            "ranks": ranks,
            "predicted": predicted,
            "measured": max(measured),
            "measured_per_rank": measured,
            "rank_errors": [(predicted - m) / m for m in measured],
            "error": (predicted - max(measured)) / max(measured),
            "breakdown": pred["ranks"][ranks[0]],
        }
        if stage is not None and held != {(stage,)}:  # the estimate's stage map vs the stages the run built
            row["stage_mismatch"] = sorted(held)
        rows.append(row)
    return rows


def slug(text: str) -> str:
    """A file-name-safe piece of a ``--match`` string."""
    import re

    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:48]


def print_table(rows: list[dict]) -> None:
    width = max(len(r["plan"]) for r in rows)
    staged = any("stage" in r for r in rows)
    head = f"{'plan'.ljust(width)}  " + (f"{'ranks (stage)':>14}  " if staged else "")
    print(head + f"{'predicted':>12}  {'measured':>12}  {'error':>7}")
    for r in rows:
        pred = f"{r['predicted'] / 2**20:9.2f} MiB" if "predicted" in r else "failed"
        meas = f"{r['measured'] / 2**20:9.2f} MiB" if "measured" in r else "failed"
        err = f"{r['error'] * 100:+6.1f}%" if "error" in r else "-"
        where = ""
        if staged:
            label = ",".join(map(str, r.get("ranks", []))) + ("" if r.get("stage") is None else f" ({r['stage']})")
            where = f"{label:>14}  "
        print(f"{r['plan'].ljust(width)}  {where}{pred:>12}  {meas:>12}  {err:>7}")
        for key in ("predict_error", "measure_error", "stage_mismatch"):
            if key in r:
                print(f"    {key}: {r[key]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--match", default=None, help="only plans whose label contains this")
    parser.add_argument("--exclude", default=None, help="leave out the plans whose label contains this")
    parser.add_argument(
        "--model-parallel",
        action="store_true",
        help="the plans with tensor / pipeline / mixed parallelism only, per stage (use with --world 4)",
    )
    args = parser.parse_args(argv)
    mp = args.model_parallel
    plans = [
        p
        for p in demo_plans(args.world)
        if (args.match is None or args.match in p[0])
        and (args.exclude is None or args.exclude not in p[0])
        and (not mp or any(name + "(" in p[0] for name in MODEL_PARALLEL))
    ][: args.limit]
    base = MODEL_PARALLEL_RESULTS if mp else RESULTS
    subset = "".join(f"_{slug(t)}" for t in (args.match, args.exclude and f"no {args.exclude}") if t)
    results = (
        base
        if not subset and args.limit is None
        else base.with_name(f"{base.stem}{subset or '_all'}{'' if args.limit is None else f'_{args.limit}'}.json")
    )
    print(f"{len(plans)} {'model-parallel ' if mp else ''}plans of the demo's space at world {args.world}")
    t0 = time.perf_counter()
    # trained as the trial worker trains this workload (it has a criterion): train_step on
    # (inputs, targets) with the criterion, the only way a pipeline plan trains; predicted with it too
    measured = measure_in_chunks([p for _, p in plans], args.world, True)
    t_measure = time.perf_counter() - t0
    rows = []
    t0 = time.perf_counter()
    for i, (label, text) in enumerate(plans):
        per_rank = [m[i] for m in measured]
        try:
            pred, why = predict(text, args.world, with_criterion=True), None
        except Exception as exc:  # noqa: BLE001
            pred, why = None, f"{type(exc).__name__}: {exc}"[:300]
        rows.extend(stage_rows(label, pred, per_rank, why))
    t_predict = time.perf_counter() - t0
    print_table(rows)
    summary = summarize(rows)
    per_rank_errors = [abs(e) for r in rows for e in r.get("rank_errors", [])]
    if per_rank_errors:
        summary.update(
            rank_rows=len(per_rank_errors),
            median_abs_rank_error=statistics.median(per_rank_errors),
            worst_abs_rank_error=max(per_rank_errors),
        )
    summary["stage_mismatches"] = sum(1 for r in rows if "stage_mismatch" in r)
    summary.update(measure_seconds=round(t_measure, 1), predict_seconds=round(t_predict, 1))
    print(json.dumps(summary, indent=2))
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "world": args.world,
                "match": args.match,
                "exclude": args.exclude,
                "model_parallel": mp,
                "summary": summary,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {results}")
    return 0 if summary.get("median_pass") and summary.get("worst_pass") else 1


if __name__ == "__main__":
    sys.exit(main())

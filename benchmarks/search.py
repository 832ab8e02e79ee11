"""Does the search find the best plan in <= 3 trials, on the full space? And against Accelerate?

    python benchmarks/search.py --small            # minutes: the small user model (2 blocks, d 128, seq 64)
    python benchmarks/search.py                    # the user model of benchmarks/steptime.py (4 blocks, d 256)
    python benchmarks/search.py --replay benchmarks/results/search.json   # replay the saved table, no measuring

1. The space is the search's own, unnarrowed: every registered family (model-parallel degrees
   included) that offers candidates for a user's GPT-like model (benchmarks/_usergpt.py) at world 2
   on this CPU, as ``search()`` enumerates it (compile stays opt-in, fp8 is out of the default
   space on a CPU, as the library decides; nothing is excluded here).
2. The table: every distinct valid plan measured once, in fresh processes, by the library's own
   trial runner (a trial measures until its figure's relative standard error is <= 1%, or its
   step / time cap; the spread is kept). The search's own loop does it (``n_trials=None``, no
   predictions, random order). ``--resume`` reuses the plans of a partial table.
3. The exhaustive best is the fastest plan of the table.
4. Replays: ``search()`` itself, default study settings (predictions from
   composable_atorch.estimate, the predicted-fastest plans first, plans predicted to lose
   skipped), ``Budget(n_trials=3)``, 10 seeds, with the measurement injected (a runner that looks
   the plan up in the table): the search decides what to measure from its predictions; the table
   answers. Each plan is predicted once (timed), shared by every replay.
5. Accelerate: the most frequent pick, Accelerate's default (``Accelerator()``, fp32 DDP) and
   ``Accelerator(mixed_precision="bf16")`` measured in interleaved rounds (``--rounds``), same model,
   data and global batch; medians.

Target (issue 21): within 3% of the exhaustive best with <= 3 measured trials in >= 8 of 10 seeds;
no trial spent on a plan that crashes, hangs or is predicted to lose. Figures taken while other
jobs run are noise-prone: the load average is printed. Saves benchmarks/results/search.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "search.json"
SRC = HERE.parent / "src"
WORLD = 2


class TableRunner:
    """The measurement injected into ``search()``: a plan's result looked up in the measured table."""

    def __init__(self, table: dict):
        self.table, self.calls = table, []

    def __call__(self, plan, *, timeout):
        from composable_atorch.auto.space import plan_key

        key = plan_key(plan)
        self.calls.append(key)
        if key not in self.table:
            raise SystemExit(
                f"the table has no measurement of {' | '.join(plan.names)} (plans or configs changed since it was "
                "measured): measure again without --replay"
            )
        return self.table[key]


class Recording:
    """The real trial runner, keeping each result in the table (saved after every trial: --resume)."""

    def __init__(self, runner, table: dict, labels: dict, plans: dict, save):
        self.runner, self.table, self.labels, self.plans, self.save = runner, table, labels, plans, save

    def __call__(self, plan, *, timeout):
        from composable_atorch.auto.space import plan_key

        key = plan_key(plan)
        if key not in self.table:
            self.table[key] = self.runner(plan, timeout=timeout)
            self.labels[key] = label(plan)
            self.plans[key] = plan.to_json(indent=None)
            self.save()
            r = self.table[key]
            what = f"{r.step_time:.4f} s/step ±{100 * (r.relative_error or 0):.1f}%" if r.ok else f"FAILED {r.reason}"
            print(f"  [{len(self.table)}] {self.labels[key]}: {what}", flush=True)
        return self.table[key]


def label(plan) -> str:
    """The plan's steps, with the degrees of mixed_parallel and accumulate's micro-batches (plans differ there)."""
    parts = []
    for t in plan.transforms:
        c = t.config()
        if t.name == "mixed_parallel":
            parts.append(f"mixed_parallel(tensor {c.get('tensor')} x pipeline {c.get('pipeline')})")
        elif t.name == "accumulate":
            parts.append(f"accumulate({c.get('steps')})")
        elif t.name != "parallel_mode":
            parts.append(t.name)
    return " | ".join(parts)


def settings():
    from composable_atorch.auto.policy import TrialSettings

    return TrialSettings(
        world_size=WORLD, warmup_steps=3, measure_steps=6, timeout=240, measure_memory=False, max_measure_s=12.0
    )


def measure_table(small: bool, table: dict, labels: dict, plans: dict, save) -> float:
    """Every valid plan of the search's space measured once, by the search's own loop."""
    import _usergpt as g

    from composable_atorch.auto import Budget, StudyOptions, search
    from composable_atorch.auto.trial import ProcessRunner

    workload = g.workload(small)
    runner = Recording(ProcessRunner(workload, settings()), table, labels, plans, save)
    start = time.monotonic()
    search(
        workload,
        trial=settings(),
        budget=Budget(n_trials=None),
        study=StudyOptions(sampler="random", seed=0, predict=False, preflight=False, baseline_first=False),
        runner=runner,
        progress=False,
    )
    return time.monotonic() - start


def replay(small: bool, table: dict, seed: int, trials: int, predictor) -> dict:
    import _usergpt as g

    from composable_atorch.auto import Budget, StudyOptions, search
    from composable_atorch.auto.space import plan_key

    runner = TableRunner(table)
    t0 = time.monotonic()
    result = search(
        g.workload(small),
        trial=settings(),
        budget=Budget(n_trials=trials),
        study=StudyOptions(seed=seed, preflight=False),
        runner=runner,
        estimator=predictor,
        progress=False,
    )
    return {
        "seed": seed,
        "pick": result.best and plan_key(result.best_plan),
        "measured": runner.calls,
        "skipped_predicted_slower": [r.plan_label for r in result.records if r.status == "predicted-slower"],
        "invalid_proposals": result.invalid_proposals,
        "search_s": time.monotonic() - t0,
        "prediction_note": result.prediction_note,
    }


def measure_accelerate(mixed: str, small: bool, steps: int, port: int) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", f"--master_port={port}"),
            *(str(HERE / "_accelerate_run.py"), "--mixed-precision", mixed, "--steps", str(steps), "--out", out),
            *(["--small"] if small else []),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode or not os.path.exists(out):
            print(f"  accelerate {mixed}: failed — {proc.stderr[-500:]}")
            return None
        return statistics.median(json.loads(Path(out).read_text())["step_times"])


def against_accelerate(small: bool, pick_json: str, rounds: int, steps: int) -> dict:
    """The pick, Accelerate's default and Accelerate bf16 in interleaved rounds: seconds per step, medians."""
    import _usergpt as g

    from composable_atorch.auto.trial import run_trial

    configs = ("pick", "accelerate", "accelerate+bf16")
    got: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs[r % 3 :] + configs[: r % 3]:
            if c == "pick":
                res = run_trial(pick_json, g.workload(small), settings())
                step = res.step_time if res.ok else None
            else:
                step = measure_accelerate("bf16" if c.endswith("bf16") else "no", small, steps, 29700 + r)
            if step is not None:
                got[c].append(step)
            print(f"  round {r + 1} {c:16s} {'-' if step is None else f'{step:.4f} s'}", flush=True)
    return {c: {"rounds": v, "median_s": statistics.median(v) if v else None} for c, v in got.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="the small user model (minutes instead of ~half an hour)")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--trials", type=int, default=3, help="the search's budget of measured trials")
    p.add_argument("--replay", default=None, help="a saved results JSON: replay its table, measure nothing")
    p.add_argument("--resume", action="store_true", help="keep the plans already in benchmarks/results/search.json")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds against Accelerate (0: none)")
    p.add_argument("--accelerate-steps", type=int, default=20)
    p.add_argument("--cached", action="store_true", help="price with the cached calibration (default: measure it)")
    args = p.parse_args(argv)

    import _usergpt as g

    import composable_atorch as ca
    from composable_atorch.auto.predict import Predictor
    from composable_atorch.auto.trial import TrialResult
    from composable_atorch.environment import Environment
    from composable_atorch.estimate import estimate
    from composable_atorch.estimate.calibrate import calibration

    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.1f} on {os.cpu_count()} cores")
    saved = json.loads(Path(args.replay or RESULTS).read_text()) if (args.replay or args.resume) else {}
    if saved and saved.get("small") != args.small:
        raise SystemExit(f"the saved table is for small={saved.get('small')}: pass --small accordingly")
    table = {k: TrialResult.from_dict(v) for k, v in saved.get("table", {}).items()}
    labels, plans = dict(saved.get("labels", {})), dict(saved.get("plans", {}))
    out = {"small": args.small, "model": g.SMALL if args.small else "default", "world_size": WORLD}

    def save(**more):
        out.update(more)
        out.update(table={k: r.to_dict() for k, r in table.items()}, labels=labels, plans=plans)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")

    table_s = saved.get("table_s", 0.0)
    if not args.replay:
        table_s += measure_table(args.small, table, labels, plans, save)
    ok = {k: r for k, r in table.items() if r.ok}
    best_key = min(ok, key=lambda k: ok[k].step_time)
    best = ok[best_key]
    print(f"\ntable: {len(table)} valid plans, {len(ok)} ran, {len(table) - len(ok)} failed; {table_s:.0f} s")
    print(f"exhaustive best: {labels[best_key]} {best.step_time:.4f} s/step ({best.samples_per_s:.1f} samples/s)")

    env = Environment.detect().with_(world_size=WORLD)
    labels.update({k: label(ca.Plan.from_json(j, env=env)) for k, j in plans.items()})
    t0 = time.monotonic()
    cal = calibration(recalibrate=not args.cached)  # the predictions below read it from the cache
    print(f"calibration: {'cached' if args.cached else 'measured'} in {time.monotonic() - t0:.1f} s")
    predictor = Predictor(estimate, g.workload(args.small), env)
    t0 = time.monotonic()
    for key in table:
        predictor(ca.Plan.from_json(plans[key], env=env))
    predict_s = time.monotonic() - t0
    fastest_pred = min(p.step_time_s for p in predictor.cache.values() if p.step_time_s)
    print(f"predictions: {len(predictor.cache)} plans in {predict_s:.1f} s")

    runs = [replay(args.small, table, seed, args.trials, predictor) for seed in range(args.seeds)]
    fastest_of: dict[str, float] = {}
    for pred in predictor.cache.values():
        if pred.step_time_s:
            fastest_of[pred.precision] = min(fastest_of.get(pred.precision, pred.step_time_s), pred.step_time_s)
    print(
        f"\n{'seed':>4} {'trials':>6} {'found s/step':>12} {'regret':>7} {'<=3%':>5} {'failed':>6} "
        f"{'pred. lose':>10}  pick"
    )
    for run in runs:
        found = table[run["pick"]].step_time if run["pick"] else None
        run["regret"] = None if found is None else found / best.step_time - 1.0
        run["failed_trials"] = sum(not table[k].ok for k in run["measured"])
        # a trial on a plan predicted slower than the fastest prediction of its compute precision by more
        # than the model's least error (the search's own rule: across dtypes the model errs most, 2x here);
        # the cross-dtype count is kept beside it
        run["predicted_to_lose"] = sum(
            (predictor.cache[k].step_time_s or 0) > fastest_of[predictor.cache[k].precision] * 1.1
            for k in run["measured"]
        )
        run["predicted_to_lose_any_dtype"] = sum(
            (predictor.cache[k].step_time_s or 0) > fastest_pred * 1.1 for k in run["measured"]
        )
        run["within_3pct"] = run["regret"] is not None and run["regret"] <= 0.03
        print(
            f"{run['seed']:>4} {len(run['measured']):>6} {found or float('nan'):>12.4f} "
            f"{100 * (run['regret'] or 0):>6.1f}% {'yes' if run['within_3pct'] else 'NO':>5} "
            f"{run['failed_trials']:>6} {run['predicted_to_lose']:>10}  {labels.get(run['pick'], '-')}"
        )
    within = sum(r["within_3pct"] for r in runs)
    wasted = sum(r["failed_trials"] + r["predicted_to_lose"] for r in runs)
    max_trials = max(len(r["measured"]) for r in runs)
    met = within >= 0.8 * args.seeds and wasted == 0 and max_trials <= args.trials
    print(
        f"\nwithin 3% of the exhaustive best in {within}/{args.seeds} seeds with <= {max_trials} trials; "
        f"{wasted} trial(s) on plans that failed or were predicted to lose in dtype: {'MET' if met else 'NOT MET'}"
        f" ({sum(r['predicted_to_lose_any_dtype'] for r in runs)} predicted to lose against any dtype's fastest)"
    )
    picks = [r["pick"] for r in runs if r["pick"]]
    pick = max(set(picks), key=picks.count)
    versus = {}
    if args.rounds:
        print(f"\nthe most frequent pick ({labels[pick]}) against Accelerate, {args.rounds} interleaved rounds:")
        versus = against_accelerate(args.small, plans[pick], args.rounds, args.accelerate_steps)
        pm, am, bm = (versus[c]["median_s"] for c in ("pick", "accelerate", "accelerate+bf16"))
        print(f"\n{'':24s} {'s/step':>8} {'samples/s':>9}")
        for name, s in (
            ("exhaustive best (table)", best.step_time),
            ("search's pick", pm),
            ("Accelerate default", am),
            ("Accelerate bf16", bm),
        ):
            print(f"{name:24s} {s or float('nan'):>8.4f} {g.GLOBAL_BATCH / s if s else float('nan'):>9.1f}")
        if pm and am and bm:
            print(f"pick: {am / pm:.2f}x Accelerate's default, {bm / pm:.2f}x Accelerate bf16 (targets 1.2x, 1.0x)")
    load_end = os.getloadavg()
    print(f"load average: {load_start[0]:.1f} at start, {load_end[0]:.1f} at the end, on {os.cpu_count()} cores")
    save(
        table_s=table_s,
        best={"key": best_key, "label": labels[best_key], "step_s": best.step_time},
        predictions={k: p.to_dict() for k, p in predictor.cache.items()},
        calibration=cal.to_dict(),
        prediction_s=predict_s,
        runs=runs,
        summary={
            "valid_plans": len(table),
            "failed_plans": len(table) - len(ok),
            "seeds_within_3pct": f"{within}/{args.seeds}",
            "max_trials": max_trials,
            "trials_on_failed_or_predicted_to_lose": wasted,
            "met": met,
            "load_average_start": load_start,
            "load_average_end": load_end,
        },
        accelerate=versus,
    )
    print(f"saved {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

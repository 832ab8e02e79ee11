"""Does the step-time model rank plans as they run? Predicted vs measured, side by side with HF Accelerate.

    python benchmarks/steptime.py [--rounds 3] [--steps 8] [--cached] [--no-llama]

1. The workload: a user's own GPT-like model (benchmarks/_usergpt.py: 4 blocks, d 256, sequence
   128, vocab 4096, SDPA), AdamW, global batch 16, world 2 on this CPU (one thread per rank).
2. The model: this machine is calibrated afresh (``--cached`` reuses the cached calibration), then
   8 data-parallel / precision / checkpoint plans are predicted by ``composable_atorch.estimate``
   (fake tensors; no plan runs for it).
3. Measured: each plan in fresh processes exactly as a search trial (``run_trial``: 3 warm-up steps,
   then ``--steps`` timed ones, the median step), and HF Accelerate's ``Accelerator()`` (fp32 DDP)
   and ``Accelerator(mixed_precision="bf16")`` on the same model, data and global batch under
   ``torchrun --nproc_per_node 2`` (``ACCELERATE_USE_CPU=1``, which ``accelerate launch --cpu`` sets;
   ``accelerate launch --cpu --num_processes 2`` itself silently runs one process). All ten run in
   interleaved rounds (the order rotates each round); a figure is the median over rounds and its
   spread (max - min) / median is printed next to it.
4. Figures: Spearman rank correlation of predicted vs measured step time over the 8 plans, whether
   the measured fastest is in the predicted top 3, each plan's throughput against Accelerate's two,
   and how long a Llama-2-7B plan at 8 ranks takes to estimate (identical blocks simulated once).

Target (the issue): Spearman >= 0.9, measured fastest in the predicted top 3, the model's pick >=
1.2x Accelerate's default and >= Accelerate bf16, 7B estimate <= 10 s. The load average is printed:
figures taken while other jobs run are noise-prone. Writes benchmarks/results/steptime.json.
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
RESULTS = HERE / "results" / "steptime.json"
SRC = HERE.parent / "src"


def plans():
    from _usergpt import Block

    import composable_atorch as ca

    fsdp = ca.fsdp(wrap=(Block,))
    return {
        "ddp": ca.ddp(),
        "ddp+amp": ca.ddp() | ca.amp("bf16"),
        "ddp+ckpt": ca.ddp() | ca.checkpoint(Block),
        "fsdp": fsdp,
        "fsdp+amp": fsdp | ca.amp("bf16"),
        "zero2": ca.zero2(wrap=(Block,)),
        "zero1": ca.zero1(),
        "ddp+amp+ckpt": ca.ddp() | ca.amp("bf16") | ca.checkpoint(Block),
    }


def workload():
    import _usergpt as g

    from composable_atorch.auto import Workload

    return Workload(g.model_fn, g.optim_fn, g.Tokens(), g.loss_fn, g.GLOBAL_BATCH, criterion=g.criterion)


def predict(world: int, cal) -> dict:
    import _usergpt as g
    import torch

    from composable_atorch.estimate import estimate

    shape = torch.Size([g.GLOBAL_BATCH, g.SEQ])
    out = {}
    for name, plan in plans().items():
        t0 = time.monotonic()
        est = estimate(
            plan,
            g.UserGPT,
            (shape, shape),
            world_size=world,
            device="cpu",
            criterion=g.criterion,
            optimizer=g.optim_fn,
            calibration=cal,
        )
        out[name] = {**est.step_time.to_dict(), "estimate_s": time.monotonic() - t0, "peak_bytes": est.peak}
        print(f"  predicted {name:14s} {est.step_time_s:.4f} s  ({out[name]['estimate_s']:.1f} s to estimate)")
    return out


def measure_plan(name: str, world: int, steps: int) -> float | None:
    import composable_atorch as ca
    from composable_atorch.auto import TrialSettings, run_trial

    env = ca.Environment.detect().with_(world_size=world)
    plan = ca.compose(plans()[name], env=env)
    settings = TrialSettings(
        world_size=world, warmup_steps=3, measure_steps=steps, timeout=600, measure_memory=False, max_measure_s=10.0
    )
    result = run_trial(plan.to_json(), workload(), settings)
    if not result.ok:
        print(f"  {name}: failed — {result.reason}")
        return None
    return result.step_time


def measure_accelerate(mixed: str, world: int, steps: int, port: int) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}"),
            *(str(HERE / "_accelerate_run.py"), "--mixed-precision", mixed, "--steps", str(steps), "--out", out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode or not os.path.exists(out):
            print(f"  accelerate {mixed}: failed — {proc.stderr[-500:]}")
            return None
        data = json.loads(Path(out).read_text())
        if data["processes"] != world:
            print(f"  accelerate {mixed}: ran {data['processes']} process(es), not {world}")
            return None
        return statistics.median(data["step_times"])


def versus_accelerate(plan: str, mixed: str, rounds: int, block: int, port: int) -> dict | None:
    """``plan`` and Accelerate (``mixed``) in the same processes, alternating blocks of steps
    (``_accelerate_run.py --versus``): medians of seconds per step, and the ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"),
            *(str(HERE / "_accelerate_run.py"), "--mixed-precision", mixed, "--versus", plan),
            *("--steps", str(rounds), "--block", str(block), "--out", out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode or not os.path.exists(out):
            print(f"  {plan} versus accelerate {mixed}: failed — {proc.stderr[-500:]}")
            return None
        data = json.loads(Path(out).read_text())
    ours, theirs = statistics.median(data["versus"][plan]), statistics.median(data["step_times"])
    return {
        "plan_s": ours,
        "accelerate_s": theirs,
        "speedup": theirs / ours,
        "steps_each": len(data["step_times"]),
        "load_average": data["load_average"],
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1.0 - 6.0 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def llama_seconds(world: int = 8) -> float:
    """Seconds to estimate ATorch's Llama-2-7B FSDP + bf16 + checkpoint plan at ``world`` ranks."""
    import torch
    from seed_table import build
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import composable_atorch as ca
    from composable_atorch.estimate import estimate

    with torch.device("meta"):  # transformers and the 7B config imported before the clock (meta: no 28 GB)
        build(False)
    plan = ca.fsdp(wrap=LlamaDecoderLayer) | ca.amp("bf16") | ca.checkpoint(LlamaDecoderLayer)
    shape = torch.Size([4 * world, 4096])
    t0 = time.monotonic()
    estimate(
        plan,
        lambda: build(False),
        {"input_ids": shape, "labels": shape},
        world_size=world,
        device="cpu",
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5),
    )
    return time.monotonic() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per trial (after 3 warm-up steps)")
    parser.add_argument("--cached", action="store_true", help="reuse the cached calibration")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=10,
        help="the pick and Accelerate alternating in the same processes, blocks of 5 steps (0: not run)",
    )
    parser.add_argument("--ab-only", action="store_true", help="only the same-process comparison of ddp+amp")
    args = parser.parse_args(argv)
    if args.ab_only:
        for mixed in ("bf16", "no"):
            r = versus_accelerate("ddp+amp", mixed, args.ab_rounds or 10, 5, 29650)
            if r:
                print(
                    f"ddp+amp {r['plan_s']:.4f} s vs Accelerate {mixed} {r['accelerate_s']:.4f} s per step: "
                    f"{r['speedup']:.2f}x (medians of {r['steps_each']} steps each, same processes; "
                    f"load {r['load_average'][0]:.1f})"
                )
        return 0
    world = 2
    from composable_atorch.estimate.calibrate import calibration

    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.1f} on {os.cpu_count()} cores")
    t0 = time.monotonic()
    cal = calibration(recalibrate=not args.cached)
    cal_s = time.monotonic() - t0
    print(f"calibration: {'cached' if args.cached else 'measured'} in {cal_s:.1f} s")
    predicted = predict(world, cal)
    configs = list(predicted) + ([] if args.no_accelerate else ["accelerate", "accelerate+bf16"])
    measured: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            if c.startswith("accelerate"):
                step = measure_accelerate("bf16" if c.endswith("bf16") else "no", world, args.steps, 29600 + r)
            else:
                step = measure_plan(c, world, args.steps)
            if step is not None:
                measured[c].append(step)
            print(f"  round {r + 1} {c:16s} {'-' if step is None else f'{step:.4f} s'}", flush=True)
    med = {c: statistics.median(v) for c, v in measured.items() if v}
    spread = {c: (max(v) - min(v)) / statistics.median(v) for c, v in measured.items() if v}
    names = [n for n in predicted if n in med]
    rho = spearman([predicted[n]["seconds"] for n in names], [med[n] for n in names])
    top3 = sorted(names, key=lambda n: predicted[n]["seconds"])[:3]
    fastest = min(names, key=lambda n: med[n])
    pick = top3[0]
    gb = 16
    table = []
    print()
    head = f"{'plan':16s} {'predicted s':>11s} {'measured s':>10s} {'spread':>7s} {'samples/s':>9s} "
    head += f"{'vs acc':>7s} {'vs acc bf16':>11s}"
    print(head)
    print("-" * len(head))
    for c in configs:
        p = predicted.get(c, {}).get("seconds")
        m = med.get(c)
        row = {
            "config": c,
            "predicted_s": p,
            "predicted": predicted.get(c),
            "measured_s": m,
            "rounds": measured[c],
            "spread": spread.get(c),
            "samples_per_s": gb / m if m else None,
            "vs_accelerate": med["accelerate"] / m if m and "accelerate" in med else None,
            "vs_accelerate_bf16": med["accelerate+bf16"] / m if m and "accelerate+bf16" in med else None,
        }
        table.append(row)

        def f(v, spec):
            return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)

        print(
            f"{c:16s} {f(p, '11.4f')} {f(m, '10.4f')} {f(row['spread'], '7.1%')} {f(row['samples_per_s'], '9.1f')} "
            f"{f(row['vs_accelerate'], '6.2f')}x {f(row['vs_accelerate_bf16'], '10.2f')}x"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": table, "calibration": cal.to_dict()}, indent=1))  # kept if the 7B part fails
    ab = {}
    if args.ab_rounds and not args.no_accelerate:
        for mixed in ("bf16", "no"):
            ab[mixed] = versus_accelerate(pick, mixed, args.ab_rounds, 5, 29660 + len(ab))
            if ab[mixed]:
                r = ab[mixed]
                print(
                    f"same processes, alternating blocks: {pick} {r['plan_s']:.4f} s vs Accelerate {mixed} "
                    f"{r['accelerate_s']:.4f} s per step: {r['speedup']:.2f}x ({r['steps_each']} steps each)"
                )
    llama = None if args.no_llama else llama_seconds()
    load_end = os.getloadavg()
    summary = {
        "spearman": rho,
        "predicted_top3": top3,
        "measured_fastest": fastest,
        "fastest_in_top3": fastest in top3,
        "model_pick": pick,
        "pick_vs_accelerate": table[configs.index(pick)]["vs_accelerate"],
        "pick_vs_accelerate_bf16": table[configs.index(pick)]["vs_accelerate_bf16"],
        "llama7b_world8_estimate_s": llama,
        "pick_vs_accelerate_same_processes": ab,
        "calibration_s": cal_s,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "cores": os.cpu_count(),
    }
    print(
        f"\nSpearman {rho:.3f} (target >= 0.9); predicted top 3 {top3}; measured fastest {fastest} "
        f"({'in' if fastest in top3 else 'NOT in'} the top 3)"
    )
    pv, pb = summary["pick_vs_accelerate"], summary["pick_vs_accelerate_bf16"]
    if pv is not None:
        print(f"model's pick {pick}: {pv:.2f}x Accelerate's default, {pb:.2f}x Accelerate bf16 (targets 1.2x, 1.0x)")
    if llama is not None:
        print(f"Llama-2-7B fsdp+amp+checkpoint at 8 ranks estimated in {llama:.1f} s (target <= 10 s)")
    print(
        f"load average: {load_start[0]:.1f} at start, {load_end[0]:.1f} at the end, on {os.cpu_count()} cores"
        + (
            " — a shared machine: rerun on a quiet one"
            if max(load_start[0], load_end[0]) > 0.5 * os.cpu_count()
            else ""
        )
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "rows": table, "calibration": cal.to_dict()}, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

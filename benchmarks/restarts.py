"""Lost and hung ranks under ``python -m composable_atorch launch``: how often does a restart recover?

    python benchmarks/restarts.py [--runs 10] [--shared-store]

1. One uninterrupted world-2 ddp run of tests/scripts/train_restart.py (10 steps, checkpoints at 4
   and 8): the reference final weights and AdamW state.
2. ``--runs`` times: the same run under ``launch --max-restarts 1`` with rank 1 SIGKILLing itself
   after step 6. A run counts as recovered when the launch exits 0 and the final state equals the
   reference bitwise. ``--shared-store`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0`` (torchrun's
   default, one store shared by every restart round) to compare with launch's default of one store
   per round.
3. Once: rank 1 SIGSTOPs itself with ``--timeout 6``; reports the exit status, the wall time and
   whether the message names rank 1 (the bound is timeout/2 for the heartbeat plus torchrun's 30 s
   grace before it SIGKILLs the stopped rank).

Saves benchmarks/results/restarts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "train_restart.py"


def run(tmp: Path, *args: str, launch_args=("--max-restarts", "1"), env=None):
    (tmp / "out").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nproc", "2", *launch_args, str(SCRIPT)]
    cmd += ["--ckpt", str(tmp / "ckpt"), "--out", str(tmp / "out"), "--steps", "10", "--save-every", "4", *args]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return result, time.monotonic() - start


def same(a: Path, b: Path) -> bool:
    if not (a.exists() and b.exists()):
        return False
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--shared-store", action="store_true")
    ns = p.parse_args()
    env = dict(os.environ)
    if ns.shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref, _ = run(tmp / "ref", env=env)
        if ref.returncode:
            sys.exit(ref.stderr[-3000:])
        outcomes = []
        for i in range(ns.runs):
            result, secs = run(tmp / f"kill{i}", "--kill", "1:6", env=env)
            ok = result.returncode == 0 and same(
                tmp / "ref/out/final.safetensors", tmp / f"kill{i}/out/final.safetensors"
            )
            outcomes.append({"recovered": ok, "exit": result.returncode, "seconds": round(secs, 1)})
            print(f"kill run {i + 1}: {'recovered bitwise' if ok else 'FAILED'} ({secs:.1f} s)", flush=True)
        stop, secs = run(tmp / "stop", "--stop", "1:3", launch_args=("--timeout", "6"), env=env)
        named = "rank 1 stopped responding" in stop.stderr
        print(f"stopped rank: exit {stop.returncode} after {secs:.1f} s; message names rank 1: {named}")
    recovered = sum(o["recovered"] for o in outcomes)
    print(f"recovered {recovered}/{ns.runs} (shared store: {ns.shared_store})")
    results = {
        "shared_store": ns.shared_store,
        "recovered": recovered,
        "runs": outcomes,
        "stopped_rank": {"exit": stop.returncode, "seconds": round(secs, 1), "named": named, "timeout_s": 6},
    }
    name = "restarts_shared_store.json" if ns.shared_store else "restarts.json"
    (ROOT / "benchmarks" / "results" / name).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

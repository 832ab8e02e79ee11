"""How long a checkpoint stalls training: blocking save_state vs save_state(..., asynchronous=True).

    python benchmarks/save_stall.py [--world 1 2] [--d-model 512] [--layers 4] [--saves 3] [--every 5]

A GPT (AdamW, so the checkpoint holds weights and two moments) trains; every ``--every`` steps it
saves. For each kind of save the training loop's stall is measured as

* ``call_s``: the time ``save_state`` blocks the loop (blocking: everything; asynchronous: staging
  the tensors into CPU memory and starting the writer thread);
* ``slowdown_s``: the extra time of the ``--every`` steps after the save over the ``--every``
  steps just before it (the writer competes for the CPU, the GIL, disk and memory bandwidth;
  paired, as other load on the machine drifts; it can come out negative by that noise);
* ``wait_s``: what is left of the write when the next save is due (``wait_for_saves``), which the
  next save would block on;
* ``stall_s`` = the sum: what the save costs the run per checkpoint.

World 2 runs fsdp on a gloo group of two spawned processes (rank 0's numbers). Prints a table and
writes benchmarks/results/save_stall.json. The numbers are this machine's (CPU, local disk); on a
GPU the staging is a device-to-host copy and the blocking save's write is the same disk write.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state import inflight

#: kind -> (asynchronous, DCP's async checkpointer); "process" needs a process group (world > 1)
KINDS = {"blocking": (False, "thread"), "async-thread": (True, "thread"), "async-process": (True, "process")}
RESULTS = Path(__file__).parent / "results" / "save_stall.json"


def _build(args, world: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=64, d_model=args.d_model, n_layer=args.layers, n_head=8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(TextDataset(64, limit=100_000), batch_size=4 * world, shuffle=True)
    plan = ca.compose(ca.fsdp(wrap=(Block,))) if world > 1 else ca.compose()
    return plan(model, optim, loader)


def _timed_steps(model, optim, batches, n: int) -> list[float]:
    out = []
    for _ in range(n):
        x, y = next(batches)
        t = time.perf_counter()
        ca.train_step(model, optim, x, y, lm_loss)
        out.append(time.perf_counter() - t)
    return out


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def measure(args, world: int, directory: str) -> dict:
    model, optim, loader = _build(args, world)
    batches = iter(loader)
    _timed_steps(model, optim, batches, 3)  # warm-up (and the optimizer's state exists)
    _barrier()
    step_s = statistics.median(_timed_steps(model, optim, batches, 2 * args.every))
    out = {"step_s": step_s, "params": sum(p.numel() for p in model.parameters())}
    kinds = [k for k in KINDS if world > 1 or KINDS[k][1] == "thread"]
    for kind in kinds:  # warm-up: first-call imports, allocations and DCP's daemon process excluded
        inflight.CHECKPOINTER = KINDS[kind][1]
        ca.save_state(f"{directory}/warm-{kind}", model, optim, loader, step=0, asynchronous=KINDS[kind][0])
        ca.wait_for_saves()
    step = 0
    for kind in kinds:
        inflight.CHECKPOINTER = KINDS[kind][1]
        rows = []
        for _ in range(args.saves):
            step += 1
            before = _timed_steps(model, optim, batches, args.every)  # paired: the machine's load drifts
            _barrier()
            t = time.perf_counter()
            ca.save_state(f"{directory}/{kind}", model, optim, loader, step=step, asynchronous=KINDS[kind][0])
            call = time.perf_counter() - t
            after = _timed_steps(model, optim, batches, args.every)
            t = time.perf_counter()
            ca.wait_for_saves()
            wait = time.perf_counter() - t
            slowdown = sum(after) - sum(before)
            rows.append({"call_s": call, "slowdown_s": slowdown, "wait_s": wait, "stall_s": call + slowdown + wait})
        out[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[kind]["runs"] = rows
    ckpt = Path(directory) / "blocking" / f"step-{args.saves:08d}"
    out["checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.iterdir()) if ckpt.exists() else None
    return out


def _rank(rank: int, world: int, args, directory: str, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure(args, world, directory)
        if rank == 0:
            queue.put(result)
    finally:
        ca.wait_for_saves()
        dist.destroy_process_group()


def run(args, world: int) -> dict:
    directory = tempfile.mkdtemp(prefix="save_stall_")
    try:
        if world == 1:
            torch.set_num_threads(1)
            return measure(args, 1, directory)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, args, directory, port, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=1800)
        for p in procs:
            p.join()
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = {}
    print(f"{'world':>5} {'save':>13} {'call s':>8} {'slowdown s':>10} {'wait s':>8} {'stall s':>8} {'step s':>7}")
    for world in args.world:
        r = run(args, world)
        results[str(world)] = r
        for kind in (k for k in KINDS if k in r):
            k = r[kind]
            print(
                f"{world:>5} {kind:>13} {k['call_s']:8.3f} {k['slowdown_s']:10.3f} {k['wait_s']:8.3f} "
                f"{k['stall_s']:8.3f} {r['step_s']:7.3f}",
                flush=True,
            )
        print(f"      checkpoint: {r['checkpoint_bytes'] / 2**20:.1f} MiB", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "what": "training stall per checkpoint, blocking vs asynchronous save_state (medians of --saves saves)",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]},
        "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

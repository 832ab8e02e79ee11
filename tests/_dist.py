"""Run a function on a real gloo process group of N spawned processes and collect the results.

    results = run_world(check_ddp, 2, cfg)      # check_ddp(rank, world, cfg) runs in each rank

The function must be importable (module level); its return value must be picklable. Spawning a
group costs ~5 s at world 2, so batch several cases per call. A rank that raises fails the call
with that rank's traceback; a group that hangs is killed after ``timeout`` seconds, leaving no
process behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, init_file, port, args, results):
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_world(fn, world: int = 2, *args, timeout: float = 300.0) -> list:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        port = free_port()
        procs = [
            ctx.Process(target=_child, args=(fn, r, world, init_file, port, args, results), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, object] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world and not errors:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    # a rank killed by a signal (or exiting without reporting) never puts a result:
                    # say which rank and how, at once, instead of waiting out the timeout
                    dead = [
                        (r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out
                    ]
                    if dead:
                        errors.append(
                            "; ".join(f"rank {r} died without a result: {_exit_reason(code)}" for r, code in dead)
                        )
                    elif time.monotonic() > deadline:
                        errors.append(f"process group of {world} timed out after {timeout:.0f} s")
                    continue
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=10 if not errors else 1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]

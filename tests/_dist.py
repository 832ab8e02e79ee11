"""Run a function on a real gloo process group of N spawned processes and collect the results.

    results = run_world(check_ddp, 2, cfg)      # check_ddp(rank, world, cfg) runs in each rank

The function must be importable (module level); its return value must be picklable. A rank that
raises fails the call with that rank's traceback; a group that hangs is killed after ``timeout``
seconds, leaving no process behind.

Ranks are forked from a "forkserver" that imported torch, transformers (its modeling code) and
composable_atorch once per test session: a spawned rank spent 5-12 s of this 2-core machine
re-importing them, each rank of each group. The server is started lazily, single-threaded (no
OpenMP pool, no gloo: it only imports), and holds no process group; every rank still creates and
destroys its own. Each rank takes the parent's environment of the moment it is started (as a
spawned one did), not the server's.
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


#: imported once in the forkserver; every rank forked from it starts with them loaded
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.nn.parallel",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "composable_atorch",
    "composable_atorch.transforms",
    "composable_atorch.auto",
    "composable_atorch.state",
    "composable_atorch.compat",
    # imported by many ranks (LoRA models; DeepSpeed engines): 0.9 s and 2.7 s each, once here instead.
    # Neither starts a thread or changes torch's settings at import; a missing one is skipped.
    "peft",
    "deepspeed",
]


def context():
    """The forkserver context, its server started (once) with the preloads and DeepSpeed on CPU: a process
    started from it begins with torch, transformers and composable_atorch imported (a spawned one
    spends seconds importing them)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    from multiprocessing import forkserver

    # the server imports with the environment it starts with: DS_ACCELERATOR as every rank sets it
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["DS_ACCELERATOR"]
        else:
            os.environ["DS_ACCELERATOR"] = saved
    return ctx


def _child(fn, rank, world, init_file, port, args, results, environ):
    os.environ.clear()
    os.environ.update(environ)
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
    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        port = free_port()
        procs = [
            ctx.Process(
                target=_child, args=(fn, r, world, init_file, port, args, results, dict(os.environ)), daemon=True
            )
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
            killed = set()
            for r, p in enumerate(procs):
                p.join(timeout=10 if not errors else 1)
                if p.is_alive():
                    p.kill()
                    p.join()
                    killed.add(r)
    if errors:
        # a peer's error ("connection reset") can arrive before a rank's own death is seen: name the
        # ranks a signal ended (not the ones ended here), whichever came first
        said = "\n".join(errors)
        errors += [
            f"rank {r} died without a result: {_exit_reason(p.exitcode)}"
            for r, p in enumerate(procs)
            if r not in killed and r not in out and (p.exitcode or 0) < 0 and f"rank {r} died" not in said
        ]
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]


def module_world(fn, world: int = 2, *args, timeout: float = 300.0):
    """A module-scoped pytest fixture (bind it to the fixture's name) whose value is
    ``run_world(fn, world, *args)``: one group for every test of a file that reads its results."""
    import pytest

    @pytest.fixture(scope="module")
    def results():
        return run_world(fn, world, *args, timeout=timeout)

    return results

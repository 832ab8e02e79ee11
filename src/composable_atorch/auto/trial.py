"""Run one plan in fresh worker processes at the target world size, with a time limit.

Each trial spawns ``world_size`` processes on a real process group (gloo on the CPU, NCCL on
GPUs), trains ``warmup_steps`` optimizer steps, then times at least ``measure_steps`` between
barriers (more until the figure is precise, see :class:`~.policy.TrialSettings`), then
measures the peak memory of one more step on every rank (see :mod:`.worker` for how). Throughput
is the distinct samples of a step over the step's time (samples/s; tokens/s where the batch
holds token ids), where a sample counts once however many ranks trained on it
(:func:`samples_per_step`). A crash, an out-of-memory error or a hang is a failed trial with its reason;
the parent kills every rank's process group on failure or timeout, and then every process that
inherited the trial's marker (:func:`marked`, :func:`reap`): a child that left the group with its
own ``os.setsid()`` still carries the marker in its environment, so nothing is left behind.
On a machine without CUDA the ranks start with glibc's malloc tuned for training, as the launcher's
do (``environment.cpu_malloc_environment``): a trial measures the step a launched run takes.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import wait

from composable_atorch.auto.policy import TrialSettings
from composable_atorch.auto.worker import RankSpec, rank_main
from composable_atorch.auto.workload import Workload
from composable_atorch.core.plan import Plan
from composable_atorch.environment import cpu_malloc_environment


@dataclass
class TrialResult:
    """What one trial measured, or why it failed. ``status`` is "ok" or "failed"."""

    status: str
    reason: str | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time: float | None = None
    peak_bytes: int | None = None  # max over ranks
    peak_bytes_per_rank: list[int | None] = field(default_factory=list)
    memory_method: str | None = None
    wall_time: float = 0.0
    losses: list[float] = field(default_factory=list)
    #: distinct samples per optimizer step across all ranks (each counted once)
    samples_per_step: float | None = None
    #: timed steps, and the relative standard error of their mean (how precise ``step_time`` is)
    measured_steps: int | None = None
    relative_error: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrialResult:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def kill_group(proc) -> None:
    """SIGKILL the rank's process group (the rank and whatever it started), then the rank itself."""
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:  # the rank has made its own group (it always does first)
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.kill()
    proc.join(10)


#: the environment variable every process of one trial (or preflight) inherits, with its own value
MARKER_ENV = "COMPOSABLE_ATORCH_TRIAL"


def new_marker() -> str:
    import uuid

    return f"{os.getpid()}-{uuid.uuid4().hex}"


@contextlib.contextmanager
def marked(marker: str):
    """Processes started inside inherit ``marker`` in their environment (keep the block to the starts).

    A process group or session is not enough to find what a trial left: a child can leave both
    with ``os.setsid()``. The environment is inherited through fork, exec and setsid alike, and
    ``/proc/<pid>/environ`` shows it (a cgroup would need privileges this library cannot assume).
    """
    from multiprocessing import resource_tracker

    # multiprocessing's shared helper starts with the first spawn: it must not carry a trial's marker
    resource_tracker.ensure_running()
    with started_with({MARKER_ENV: marker}):
        yield marker


@contextlib.contextmanager
def started_with(settings: dict[str, str]):
    """Processes started inside have ``settings`` in their environment; this one's is restored after."""
    previous = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _marked_pids(marker: str) -> list[int]:
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def reap(marker: str, rounds: int = 20) -> int:
    """SIGKILL every process carrying ``marker`` until none is left (a dying parent may have forked
    once more); returns how many were killed. Without ``/proc`` (not Linux), nothing is found:
    the process groups :func:`kill_group` kills are then all there is."""
    if not os.path.isdir("/proc"):
        return 0
    killed = 0
    for _ in range(rounds):
        pids = _marked_pids(marker)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.05)
    return killed


def _signal_reason(code: int) -> str:
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
    if name == "SIGKILL":
        return "out of memory (killed by SIGKILL, as the kernel's out-of-memory killer does)"
    return f"crash (killed by {name})"


#: what a failed rank's reason says when the rank ended before its log began (during its start-up)
STARTUP_FAILURE = (
    "the rank ended while starting, before its log began; its error went to this process's stderr. A "
    "script that starts the search outside an `if __name__ == \"__main__\":` block is run again by every "
    "rank (each rank imports the main module) and fails there"
)


def _log_tail(out_dir: str, rank: int, lines: int = 6) -> str:
    path = os.path.join(out_dir, f"rank{rank}.log")
    if not os.path.exists(path):
        return STARTUP_FAILURE
    with open(path, errors="replace") as f:
        tail = [ln.rstrip() for ln in f.readlines() if ln.strip()][-lines:]
    return " | ".join(tail)


def _read(out_dir: str, rank: int) -> dict | None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _spawn(spec_for: Callable[[str], RankSpec], world: int, timeout: float, on_progress=None):
    """Start the ranks, wait for them (calling ``on_progress`` with rank 0's messages), kill on failure.

    Returns ``(per-rank JSON or None, failure reason or None, wall seconds)``.
    """
    ctx = mp.get_context("spawn")
    start = time.monotonic()
    marker = new_marker()
    with tempfile.TemporaryDirectory(prefix="composable-atorch-trial-") as tmp:
        spec = spec_for(tmp)
        progress = ctx.Queue() if on_progress is not None else None
        procs = [ctx.Process(target=rank_main, args=(r, spec, progress), name=f"trial-rank{r}") for r in range(world)]
        failure = None
        try:
            # on the CPU, glibc's malloc tuned as the launcher's ranks have it: a trial measures their step
            with marked(marker), started_with(cpu_malloc_environment()):
                for p in procs:
                    p.start()
            deadline = start + timeout
            while True:
                if progress is not None:
                    with contextlib.suppress(queue.Empty):
                        while True:
                            on_progress(*progress.get_nowait())
                codes = [p.exitcode for p in procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    rank, code = bad[0]
                    data = _read(tmp, rank)
                    if data and data.get("status") == "error":
                        failure = f"{data['kind']} on rank {rank}: {data['reason']}"
                    elif code < 0:
                        failure = f"{_signal_reason(code)} on rank {rank}: {_log_tail(tmp, rank)}"
                    else:
                        failure = f"crash on rank {rank} (exit code {code}): {_log_tail(tmp, rank)}"
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    late = [r for r, c in enumerate(codes) if c is None]
                    failure = f"timeout: rank(s) {late} still running after {timeout:.0f} s (hang); killed"
                    break
                wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.1)
        finally:
            for p in procs:
                if p.exitcode is None or failure is not None:
                    kill_group(p)
                else:
                    p.join(10)
            reap(marker)  # what left the ranks' groups (its own setsid()) and still runs
            if progress is not None:
                with contextlib.suppress(queue.Empty, OSError, ValueError, EOFError):
                    while True:
                        on_progress(*progress.get_nowait())
                progress.close()
                progress.cancel_join_thread()
        results = [_read(tmp, r) for r in range(world)]
    return results, failure, time.monotonic() - start


def run_trial(plan_json: str, workload: Workload, settings: TrialSettings, trusted: tuple = ()) -> TrialResult:
    """Measure one plan (its JSON) in fresh processes; never raises for what the plan does.

    ``trusted``: the classes and functions the plan names that the caller holds as objects
    (:meth:`Plan.named_objects`): they travel with the workload, by reference, and the ranks read the
    plan against them rather than the allow-list (the plan is the library's own, not a file's)."""

    def spec_for(tmp: str) -> RankSpec:
        return RankSpec(
            trusted=tuple(trusted),
            plan_json=plan_json,
            workload=workload,
            world_size=settings.world_size,
            out_dir=tmp,
            init_file=os.path.join(tmp, "pg_init"),
            warmup_steps=settings.warmup_steps,
            measure_steps=settings.measure_steps,
            measure_memory=settings.measure_memory,
            timeout=settings.timeout,
            precision=settings.precision,
            max_measure_steps=settings.max_measure_steps,
            max_measure_s=settings.max_measure_s,
        )

    results, failure, wall = _spawn(spec_for, settings.world_size, settings.timeout)
    if failure is not None:
        return TrialResult(status="failed", reason=failure, wall_time=wall)
    head = results[0]
    # rank 0's median step (under data parallelism each step waits for the slowest rank) resists
    # the pauses of a shared machine better than the mean
    step_time = statistics.median(head["step_times"])
    split = head.get("sequence_split", 1)  # what the plan the ranks composed cuts each sequence into
    per_step = samples_per_step(results, workload.batch_size, split)
    samples = per_step / step_time
    tokens = samples * head["tokens_per_sample"] * split if head.get("tokens_per_sample") else None
    peaks = [r.get("peak_bytes") for r in results]
    known = [p for p in peaks if p is not None]
    return TrialResult(
        status="ok",
        samples_per_s=samples,
        tokens_per_s=tokens,
        step_time=step_time,
        peak_bytes=max(known) if known else None,
        peak_bytes_per_rank=peaks,
        memory_method=head.get("memory_method"),
        wall_time=wall,
        losses=head.get("losses", []),
        samples_per_step=per_step,
        measured_steps=len(head["step_times"]),
        relative_error=head.get("relative_error"),
    )


def samples_per_step(results: list[dict], global_batch: int, split: int = 1) -> float:
    """Distinct samples trained per optimizer step, each counted once across ranks.

    Ranks that repeat each other's samples (a plan with no data parallelism, tensor-parallel peers)
    add nothing; ranks on disjoint shards of the batch add theirs. Counted from what the ranks
    report they consumed (one digest per sample, per measured step); when a batch has no tensor to
    tell samples apart by, the global batch is assumed. ``split``: the parts each sequence is cut
    into over the ranks (:func:`~.space.sequence_split`): every part has its own digest, so one sample shows
    as ``split`` of them.
    """
    ids = [r.get("sample_ids") for r in results]
    if not ids or any(i is None for i in ids):
        return float(global_batch)
    steps = min(len(i) for i in ids)
    if steps == 0:
        return float(global_batch)
    distinct = sum(len(set().union(*(rank[s] for rank in ids))) for s in range(steps))
    return distinct / steps / split


def train_plan(
    plan_json: str,
    workload: Workload,
    *,
    world_size: int,
    steps: int,
    timeout: float,
    on_step: Callable[[int, float], None] | None = None,
    trusted: tuple = (),
) -> tuple[list[float] | None, str | None]:
    """Train a plan for ``steps`` optimizer steps at ``world_size``: (rank 0's losses, failure or None)."""

    def spec_for(tmp: str) -> RankSpec:
        return RankSpec(
            trusted=tuple(trusted),
            plan_json=plan_json,
            workload=workload,
            world_size=world_size,
            out_dir=tmp,
            init_file=os.path.join(tmp, "pg_init"),
            mode="train",
            train_steps=steps,
            timeout=timeout,
        )

    results, failure, _ = _spawn(spec_for, world_size, timeout, on_progress=on_step or (lambda *_: None))
    if failure is not None:
        return None, failure
    return results[0]["losses"], None


class ProcessRunner:
    """Runs a plan in fresh worker processes (the default runner).

    This is where a workload enters worker processes, for the search and for ATorch's dry run alike,
    so its picklability is checked here, once, before any work.
    """

    def __init__(self, workload: Workload, settings: TrialSettings):
        workload.check_picklable()
        self.workload, self.settings = workload, settings

    def __call__(self, plan: Plan, *, timeout: float) -> TrialResult:
        return run_trial(
            plan.to_json(), self.workload, replace(self.settings, timeout=timeout), trusted=plan.named_objects()
        )

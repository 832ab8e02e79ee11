"""This machine's own speeds, measured once and cached: what the step-time model (:mod:`.steptime`) prices ops with.

    cal = calibration()                    # the cached one, measured first if there is none (< ~30 s)
    cal = calibration(recalibrate=True)    # measure again (a new machine image, a changed torch)

Why measure instead of a datasheet: on a CPU the speed of an op depends on its size far more than
on peak FLOPs (a bf16 GEMM on AMX is ~7x fp32 on large shapes and slower than fp32 on tiny ones,
where the cast and the call dominate), and the process group's latency is the library's gloo, not
a network's. So each kind of op gets a *curve* of measured (size, seconds) points, read by
interpolation: matmul per dtype (size = FLOPs), attention per dtype (FLOPs), elementwise / memory
traffic (bytes moved), and all-reduce / all-gather / reduce-scatter at world 2 (bytes of the full
tensor), plus the framework's cost per dispatched op (autograd, module hooks: what a tiny model's
step is made of). Measured with the trial's thread count (the trial worker runs one thread per rank).
Where the curves are too coarse (a memory-bound op's time depends on the op, not only its bytes), an
estimate on this same CPU re-runs each small op at its own shapes instead (``kernels.replay_seconds``).

The cache is JSON (never pickle) under the user's cache dir, one file per machine (host, CPU, torch
version, threads): a file that does not read back as a calibration is a :class:`CalibrationError`
from :func:`load`; :func:`calibration` then measures again and rewrites it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from composable_atorch.estimate.inputs import EstimateError

VERSION = 1
#: curves every calibration holds (name -> what x is)
CURVES = {
    "mm_float32": "flops",
    "mm_bfloat16": "flops",
    "sdpa_float32": "flops",
    "sdpa_bfloat16": "flops",
    "memory": "bytes",
    "all_reduce": "bytes",
    "all_gather": "bytes",
    "reduce_scatter": "bytes",
}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
#: curves measured since the first calibrations: read when present, else the step-time model falls back
#: (an attention backward to the attention curve, a broadcast to the all-gather's); a file without them
#: is still a calibration
OPTIONAL_CURVES = {"sdpa_bwd_float32": "flops", "sdpa_bwd_bfloat16": "flops", "broadcast": "bytes"}


class CalibrationError(EstimateError):
    """A calibration file that cannot be used (unreadable, another version, a missing or bad curve)."""

    def __init__(self, path: str | os.PathLike, error: str):
        super().__init__(
            f"the step-time calibration {path} cannot be used",
            error,
            "calibration(recalibrate=True) measures this machine again and rewrites it (or delete the file)",
        )


@dataclass(frozen=True)
class Curve:
    """Measured ``(x, seconds)`` points, read piecewise-linearly: below the smallest point the time
    is its floor (a call costs at least that), above the largest the largest point's rate goes on."""

    points: tuple[tuple[float, float], ...]

    def __call__(self, x: float) -> float:
        pts = self.points
        if x <= 0:
            return 0.0
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, t0), (x1, t1) in zip(pts, pts[1:]):
            if x <= x1:
                return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
        x_last, t_last = pts[-1]
        return t_last * x / x_last

    @classmethod
    def of(cls, points) -> Curve:
        pts = sorted((float(x), float(t)) for x, t in points)
        # a noisy measurement must not make a larger op cheaper: keep the times non-decreasing
        out: list[tuple[float, float]] = []
        for x, t in pts:
            if out and x <= out[-1][0]:
                continue
            out.append((x, max(t, out[-1][1]) if out else t))
        return cls(tuple(out))


@dataclass(frozen=True)
class Calibration:
    """Curves by name (:data:`CURVES`), the framework's seconds per dispatched op, and where it was measured."""

    curves: dict[str, Curve]
    per_op_s: float
    world: int = 2
    machine: dict = field(default_factory=dict)
    #: measured with ``kernels.replay_seconds`` (``per_op_s`` is then what remains beyond the replayed
    #: kernels): an estimate on this CPU re-runs each small op at its own shapes (:meth:`replays_here`)
    replay: bool = False

    def curve(self, name: str) -> Curve:
        return self.curves[name]

    def replays_here(self) -> bool:
        """Whether an estimate may price ops by re-running them here: a replay calibration of this very
        CPU (host, processor, torch). A recorded or foreign calibration prices by its curves alone."""
        if not self.replay:
            return False
        here = machine_facts(int(self.machine.get("threads", 1)))
        return all(self.machine.get(k) == here[k] for k in ("host", "cpu", "torch"))

    def to_dict(self) -> dict:
        return {
            "version": VERSION,
            "per_op_s": self.per_op_s,
            "world": self.world,
            "machine": self.machine,
            "replay": self.replay,
            "curves": {k: [list(p) for p in c.points] for k, c in self.curves.items()},
        }

    @classmethod
    def from_dict(cls, data, source: str = "<dict>") -> Calibration:
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise CalibrationError(source, f"not a version-{VERSION} calibration")
        curves = {}
        given = data.get("curves") or {}
        for name in [*CURVES, *(n for n in OPTIONAL_CURVES if n in given)]:
            pts = given.get(name)
            ok = (
                isinstance(pts, list)
                and pts
                and all(
                    isinstance(p, list)
                    and len(p) == 2
                    and all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in p)
                    for p in pts
                )
            )
            if not ok:
                raise CalibrationError(source, f"curve {name!r} missing or not a list of positive [x, seconds] pairs")
            curves[name] = Curve.of(pts)
        per_op = data.get("per_op_s")
        if not isinstance(per_op, int | float) or not math.isfinite(per_op) or per_op < 0:
            raise CalibrationError(source, "per_op_s missing or not a non-negative number")
        machine = dict(data.get("machine") or {})
        return cls(curves, float(per_op), int(data.get("world", 2)), machine, data.get("replay") is True)


def machine_facts(threads: int) -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": socket.gethostname(), "cpu": cpu, "torch": torch.__version__, "threads": threads}


def cache_path(threads: int = 1) -> Path:
    """``$COMPOSABLE_ATORCH_CACHE`` or ``~/.cache/composable_atorch``, one file per machine and thread count."""
    root = Path(os.environ.get("COMPOSABLE_ATORCH_CACHE") or Path.home() / ".cache" / "composable_atorch")
    # "replay": calibrations measured before per-op replay (1), or before its calls were timed in turns
    # over copies of their arguments (2), are left behind (measured again once)
    facts = machine_facts(threads) | {"replay": 2}
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"calibration-{key}.json"


def gpu_cache_path(device_name: str) -> Path:
    """One file per host, card and torch version, beside the CPU calibrations."""
    import torch

    facts = {"host": socket.gethostname(), "gpu": device_name, "torch": torch.__version__}
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    return cache_path().parent / f"calibration-gpu-{key}.json"


def load(path: str | os.PathLike) -> Calibration:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise CalibrationError(path, f"{type(exc).__name__}: {exc}") from None
    return Calibration.from_dict(data, str(path))


def save(cal: Calibration, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cal.to_dict(), indent=1))
    os.replace(tmp, path)  # whole or not at all: a concurrent reader never sees half a file


_MEMO: dict[str, Calibration] = {}


def calibration(
    *, recalibrate: bool = False, threads: int = 1, path: str | os.PathLike | None = None, device: str = "cpu"
) -> Calibration:
    """The cached calibration of this machine, measured (and cached) when there is none, when the
    file cannot be used, or when ``recalibrate``. ``device="cuda"``: the GPU's curves (GEMM,
    attention, memory, NCCL over its GPUs; ``estimate/paper/calibrate.py``), which estimates on
    this machine then price with (``paper.calibrate.as_hardware``)."""
    if device not in ("cpu", "cuda"):
        from composable_atorch.errors import ConfigError

        raise ConfigError("calibration device", device, "'cpu' or 'cuda'")
    measure_now = lambda: measure(threads=threads)  # noqa: E731
    if device == "cuda":
        from composable_atorch.estimate.paper import calibrate as gpu

        if path is None:
            import torch

            if not torch.cuda.is_available():
                gpu.measure()  # raises the EstimateError naming the fix
            path = gpu_cache_path(torch.cuda.get_device_name())
        measure_now = lambda: Calibration.from_dict(gpu.measure(), "GPU measurement")  # noqa: E731
    path = Path(path) if path is not None else cache_path(threads)
    if not recalibrate:
        if str(path) in _MEMO:
            return _MEMO[str(path)]
        if path.exists():
            try:
                _MEMO[str(path)] = load(path)
                return _MEMO[str(path)]
            except CalibrationError:
                pass  # measured again below
    cal = measure_now()
    save(cal, path)
    _MEMO[str(path)] = cal
    return cal


# -- measuring ------------------------------------------------------------------------------------
def _seconds(fn, min_s: float = 0.02, repeats: int = 3) -> float:
    """Median over ``repeats`` of the mean time of ``fn()`` over enough calls to take ``min_s``."""
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < min_s / 4 or n < 1:
        fn()
        n += 1
    per = (time.perf_counter() - start) / n
    inner = max(1, int(min_s / max(per, 1e-7)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return sorted(samples)[len(samples) // 2]


def measure_compute() -> dict:
    """Matmul, attention and memory curves, and the framework's time per op, in this process."""
    import torch
    from torch.nn import functional as F

    curves: dict[str, list] = {}
    attention = ((1, 1, 16, 16), (2, 4, 64, 32), (4, 4, 128, 64), (4, 8, 256, 64))
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            pts = []
            for n in (16, 64, 256, 512, 1024):
                a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
                # a Linear's forward and backward run its GEMM in three layouts (x @ W.t(), g @ W,
                # g.t() @ x): their mean is what a training step pays. One layout alone misleads: on
                # this CPU bf16 ran ~20x slower with a transposed first operand than without
                layouts = (
                    lambda a=a, b=b: torch.mm(a, b),
                    lambda a=a, b=b: torch.mm(a, b.t()),
                    lambda a=a, b=b: torch.mm(a.t(), b),
                )
                pts.append([2.0 * n**3, sum(_seconds(f) for f in layouts) / len(layouts)])
            curves[f"mm_{name}"] = pts
            pts = []
            for b, h, s, d in attention:
                q = torch.randn(b, h, s, d, dtype=dtype)
                pts.append([4.0 * b * h * s * s * d, _seconds(lambda q=q: F.scaled_dot_product_attention(q, q, q))])
            curves[f"sdpa_{name}"] = pts
    for dtype in (torch.float32, torch.bfloat16):
        # the attention backward per FLOP is several times the forward's on the CPU (measured: a bf16
        # step's flash-attention backward took 9x its forward for 2.5x the FLOPs): its own curve
        from torch.utils.flop_counter import sdpa_backward_flop_count

        pts = []
        for b, h, s, d in attention:
            q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
            out = F.scaled_dot_product_attention(q, q, q)
            grad = torch.ones_like(out)
            flops = sdpa_backward_flop_count(grad.shape, q.shape, q.shape, q.shape)
            pts.append(
                [float(flops), _seconds(lambda q=q, out=out, grad=grad: torch.autograd.grad(out, q, grad, True))]
            )
        curves[f"sdpa_bwd_{str(dtype).removeprefix('torch.')}"] = pts
    with torch.no_grad():
        pts = []
        for n in (64, 4096, 2**17, 2**20, 2**22):
            x, y = torch.randn(n), torch.randn(n)
            pts.append([12.0 * n, _seconds(lambda x=x, y=y: torch.add(x, y))])
        curves["memory"] = pts
    return {"curves": curves, "per_op_s": _framework_per_op(curves)}


def _framework_per_op(curves: dict) -> float:
    """Seconds per dispatched op a training step adds to the kernels (autograd, module calls, Python):
    a tiny MLP's forward and backward, minus what its kernels cost replayed one by one, per op."""
    import torch

    from composable_atorch.estimate.steptime import OpTrace

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(8)])
    x = torch.randn(8, 16)

    def step():
        model(x).sum().backward()

    trace = OpTrace()
    with trace:
        step()
    measured = _seconds(step, min_s=0.05)
    partial = Calibration({k: Curve.of(v) for k, v in curves.items()} | _placeholder_comm(), 0.0)
    kernels = trace.price(partial, replay=True)["compute"]
    return max(0.0, (measured - kernels) / max(trace.op_count, 1))


def _placeholder_comm() -> dict:
    return {name: Curve(((1.0, 1e-9),)) for name in COLLECTIVES}


#: full-tensor sizes (bytes) the collectives are measured at
COMM_SIZES = (4096, 2**18, 2**22, 2**24)


def _comm_rank(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank of the collectives measurement (run by :func:`measure_comm` as a subprocess)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = {name: [] for name in (*COLLECTIVES, "broadcast")}
    for nbytes in COMM_SIZES:
        n = nbytes // 4
        full, part = torch.ones(n), torch.ones(n // world)
        ops = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda full=full, part=part: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda full=full, part=part: dist.reduce_scatter_tensor(part, full),
            # ZeRO-1 broadcasts each updated parameter from its owner: on the all-gather curve (its
            # floor measured 1-2 ms here in a loop) 53 small ones were priced at 100 ms, 3x what they took
            "broadcast": lambda full=full: dist.broadcast(full, 0),
        }
        for name, op in ops.items():
            for _ in range(2):
                op()
            reps = 10 if nbytes < 2**20 else 4
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                op()
            result[name].append([float(nbytes), (time.perf_counter() - t0) / reps])
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure_comm(world: int = 2, timeout: float = 120.0) -> dict:
    """All-reduce / all-gather / reduce-scatter curves of a real gloo group of ``world`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "import sys; from composable_atorch.estimate.calibrate import _comm_rank as f; " + (
            "f(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])"
        )
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(r), str(world), init, out], env=env) for r in range(world)
        ]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes) or not os.path.exists(out):
            raise EstimateError(
                "measuring the process group's collectives failed",
                f"exit codes {codes}",
                "check that gloo can open local ports on this machine",
            )
        return json.loads(Path(out).read_text())


def measure(threads: int = 1, world: int = 2) -> Calibration:
    """Measure this machine now (compute in this process with ``threads`` threads, collectives on a
    real gloo group of ``world`` processes)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compute = measure_compute()
    finally:
        torch.set_num_threads(before)
    curves = {**compute["curves"], **measure_comm(world)}
    return Calibration.from_dict(
        {
            "version": VERSION,
            "per_op_s": compute["per_op_s"],
            "world": world,
            "machine": machine_facts(threads) | {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")},
            "curves": curves,
            "replay": True,
        }
    )

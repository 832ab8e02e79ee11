"""A GPU's own curves, measured on the card and stored as the CPU calibration is stored.

    from composable_atorch.estimate.calibrate import calibration
    cal = calibration(device="cuda")      # measured once per machine (GEMM, attention, memory, NCCL)
    hw = as_hardware(cal)                 # the catalog's figures, the measured curves in their place

The same :class:`~composable_atorch.estimate.calibrate.Calibration` JSON as the CPU's (``version``,
``curves`` of ``[x, seconds]`` points, ``machine``): GEMMs per dtype and attention (x = FLOPs),
memory traffic (x = bytes), and the all-reduce / all-gather / reduce-scatter curves over every GPU
of the machine on NCCL (x = bytes of the full tensor; ``world`` says over how many). The machine
facts name the card, which selects the catalog entry the measured curves replace figures of; a
curve that was not measured (fp8 on a card without fp8, collectives on one GPU) keeps the paper
figure. The paper figures stay the default: an estimate uses a calibration only where this
machine has one (``estimate.paper.setup.calibrated_hardware``).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

from composable_atorch.estimate.inputs import EstimateError
from composable_atorch.hardware import Efficiency, Hardware, HardwareError, for_device_name
from composable_atorch.hardware.spec import Link

#: attention is measured at batch x heads x head dim = ATTENTION_SHAPE over sequence lengths
ATTENTION_SHAPE = (4, 32, 128)
SEQS = (512, 1024, 2048, 4096, 8192)
GEMM_SIZES = (512, 1024, 2048, 4096, 8192)
MEMORY_SIZES = (2**16, 2**20, 2**24, 2**28)
COMM_SIZES = (2**16, 2**20, 2**24, 2**28)
DTYPES = ("float32", "bfloat16", "float16")


def _fractions(points, scale) -> tuple[tuple[float, float], ...]:
    """``[x, seconds]`` points as ``(x, fraction)`` of a peak: ``scale(x, seconds)``, kept within (0, 1.5]."""
    out = []
    for x, seconds in points:
        frac = scale(x, seconds)
        if math.isfinite(frac) and frac > 0:
            out.append((x, min(frac, 1.5)))
    return tuple(out)


def as_hardware(cal, base: Hardware | None = None) -> Hardware:
    """The catalog entry of the calibrated card with its measured curves in place of the paper's."""
    machine = cal.machine or {}
    base = base or for_device_name(str(machine.get("gpu", "")))
    if base is None:
        raise HardwareError(
            "calibration machine.gpu", machine.get("gpu"), "a card the catalog knows (or pass base=Hardware(...))"
        )
    where = f"measured on {machine.get('gpu')} ({machine.get('measured_at', 'unknown date')})"
    curves = {name: [list(p) for p in c.points] for name, c in cal.curves.items()}
    gemm = dict(base.gemm)
    for dtype in DTYPES:
        pts = curves.get(f"mm_{dtype}")
        if pts and not machine.get("placeholder_" + dtype):
            peak = base.peak(dtype)
            gemm[dtype] = Efficiency(_fractions(pts, lambda f, s, peak=peak: f / s / peak), f"GEMM {where}")
    attention = dict(base.attention)
    b, h, d = machine.get("attention_shape", ATTENTION_SHAPE)
    for kind, name in (("sdpa", "flash_fwd"), ("sdpa_bwd", "flash_bwd")):
        pts = curves.get(f"{kind}_bfloat16")
        if pts:
            # measured non-causal at a fixed batch x heads x dim: the key length from the FLOPs
            # (torch's flop counter: a backward is 2.5 forwards)
            seq = [(math.sqrt(f / (4.0 * b * h * d * (2.5 if kind == "sdpa_bwd" else 1))), f, s) for f, s in pts]
            peak = base.peak("bfloat16")
            attention[name] = Efficiency(tuple((q, min(1.5, f / s / peak)) for q, f, s in seq), f"attention {where}")
    memory = base.memory
    if curves.get("memory"):
        bw = base.memory_bandwidth
        memory = Efficiency(_fractions(curves["memory"], lambda n, s: n / s / bw), f"memory traffic {where}")
    intra = base.intra
    world = int(cal.world or 1)
    if world >= 2 and all(curves.get(k) for k in ("all_reduce", "all_gather", "reduce_scatter")):
        measured = dict(intra.collectives)
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            factor = 2.0 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
            link = intra.bandwidth
            measured[kind] = Efficiency(
                _fractions(curves[kind], lambda n, s, factor=factor, link=link: n * factor / s / link),
                f"NCCL {kind} over {world} GPUs {where}",
            )
        intra = Link(intra.bandwidth, intra.kind, measured, intra.source)
    return base.replace(
        name=f"{base.name} (calibrated)",
        gemm=gemm,
        attention=attention,
        memory=memory,
        intra=intra,
        sources={**dict(base.sources), "calibration": where},
    )


# -- measuring (on the card) ----------------------------------------------------------------------------
def _cuda_seconds(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` between CUDA events, after a warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1000.0)
    return sorted(samples)[len(samples) // 2]


def measure_compute() -> dict:
    """GEMM, attention and memory curves of GPU 0 (the CPU calibration's curve names)."""
    import torch
    from torch.nn import functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count

    curves: dict[str, list] = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            pts = []
            for n in GEMM_SIZES:
                a = torch.randn(n, n, device="cuda", dtype=dtype)
                pts.append([2.0 * n**3, _cuda_seconds(lambda a=a: a @ a)])
            curves[f"mm_{str(dtype).removeprefix('torch.')}"] = pts
    b, h, d = ATTENTION_SHAPE
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        fwd, bwd = [], []
        for s in SEQS:
            q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
            with torch.no_grad():
                fwd.append(
                    [4.0 * b * h * s * s * d, _cuda_seconds(lambda q=q: F.scaled_dot_product_attention(q, q, q))]
                )
            out = F.scaled_dot_product_attention(q, q, q)
            grad = torch.ones_like(out)
            flops = float(sdpa_backward_flop_count(grad.shape, q.shape, q.shape, q.shape))
            bwd.append([flops, _cuda_seconds(lambda out=out, q=q, g=grad: torch.autograd.grad(out, q, g, True))])
        curves[f"sdpa_{name}"], curves[f"sdpa_bwd_{name}"] = fwd, bwd
    with torch.no_grad():
        pts = []
        for nbytes in MEMORY_SIZES:
            x = torch.empty(nbytes // 4, device="cuda")
            y = torch.empty_like(x)
            pts.append([2.0 * nbytes, _cuda_seconds(lambda x=x, y=y: y.copy_(x))])
        curves["memory"] = pts
    return curves


def measure_comm_rank(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank of the NCCL measurement (spawned per GPU by :func:`measure`)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = {name: [] for name in ("all_reduce", "all_gather", "reduce_scatter")}
    for nbytes in COMM_SIZES:
        full = torch.ones(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        part = torch.ones(nbytes // 2 // world, device="cuda", dtype=torch.bfloat16)
        ops = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda full=full, part=part: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda full=full, part=part: dist.reduce_scatter_tensor(part, full),
        }
        for name, op in ops.items():
            dist.barrier()
            result[name].append([float(nbytes), _cuda_seconds(op)])
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(timeout: float = 300.0) -> dict:
    """The calibration's dict: compute curves on GPU 0, NCCL curves over every GPU here (2 or more)."""
    import subprocess
    import sys
    import tempfile

    import torch

    if not torch.cuda.is_available():
        raise EstimateError(
            "calibration(device='cuda') measures a GPU",
            "no CUDA device here",
            "run it on the GPU machine; without one the estimate prices on the catalog's paper figures",
        )
    curves = measure_compute()
    world = torch.cuda.device_count()
    if world >= 2:
        with tempfile.TemporaryDirectory() as tmp:
            init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
            code = (
                "import sys; from composable_atorch.estimate.paper.calibrate import measure_comm_rank as f; "
                "f(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])"
            )
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            procs = [
                subprocess.Popen([sys.executable, "-c", code, str(r), str(world), init, out], env=env)
                for r in range(world)
            ]
            codes = [p.wait(timeout=timeout) for p in procs]
            if any(codes) or not os.path.exists(out):
                raise EstimateError(
                    "measuring NCCL collectives failed", f"exit codes {codes}", "check NCCL on this machine"
                )
            curves.update(json.loads(Path(out).read_text()))
    else:  # one GPU: no collective to measure; the catalog's figures are used (as_hardware keeps them)
        curves.update({k: [[1.0, 1e-9]] for k in ("all_reduce", "all_gather", "reduce_scatter")})
    return {
        "version": 1,
        "per_op_s": 0.0,
        "world": world,
        "machine": {
            "host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "attention_shape": list(ATTENTION_SHAPE),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "curves": curves,
    }

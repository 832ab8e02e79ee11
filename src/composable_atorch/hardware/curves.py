"""The efficiency figures the catalog's devices share, each with the measurement it comes from.

None of these is fitted to an end-to-end training table (those are what the model is checked
against). Where no measurement of a device is published, the figure of the nearest measured device
is used and its source says so ("assumed ...").

Sizes: GEMM curves read the FLOPs of one GEMM (the roofline in ``estimate/paper/ops.py`` adds the
memory-bound side and the launch floor, so one ceiling per dtype suffices); attention curves read
the key sequence length of one call; the memory curve reads bytes moved by one kernel; collective
curves read bytes per rank (NCCL's latency model in ``estimate/paper/comm.py`` adds the small-message
side).
"""

from __future__ import annotations

from composable_atorch.hardware.spec import COLLECTIVES, Efficiency, flat

MAMF = (
    "Maximum Achievable Matmul FLOPS (mean of 100 matmuls at the best shape found), S. Bekman, "
    "ml-engineering, compute/accelerator/README.md (stas00/ml-engineering @744d01e)"
)


def mamf(fraction: float, device: str, dtype: str = "bf16") -> Efficiency:
    """A GEMM ceiling from the MAMF table (fraction of the dense peak)."""
    return flat(fraction, f"{device} {dtype}: {fraction:.1%} of peak, {MAMF}")


def assumed(fraction: float, why: str) -> Efficiency:
    return flat(fraction, f"assumed: {why}")


# -- attention -------------------------------------------------------------------------------------
FA2_PAPER = "FlashAttention-2 (T. Dao, arXiv 2307.08691): 50-73% of the A100's peak in the forward pass"
#: A100 flash forward: the paper's range, rising with the sequence (short sequences leave SMs idle)
FLASH_A100_FWD = Efficiency(((512.0, 0.50), (2048.0, 0.65), (8192.0, 0.72)), FA2_PAPER)
FLASH_A100_BWD = Efficiency(
    ((512.0, 0.40), (2048.0, 0.52), (8192.0, 0.58)),
    FA2_PAPER + "; the backward (5 GEMMs, the forward's scores recomputed) taken at 0.8x the forward",
)
SDPA_H100 = (
    "torch SDPA flash (FlashAttention-2 kernel) on H100, d=128: 287-304 TFLOP/s forward at sequence 1k-16k "
    "(pytorch/benchmark PR #2296, commit d5f0a12)"
)
FLASH_H100_FWD = Efficiency(((1024.0, 0.29), (4096.0, 0.30), (16384.0, 0.31)), SDPA_H100)
FLASH_H100_BWD = Efficiency(
    ((1024.0, 0.23), (4096.0, 0.24), (16384.0, 0.25)), SDPA_H100 + "; the backward taken at 0.8x the forward"
)
#: the memory-efficient kernel (xFormers' cutlass kernel in torch): below flash on every published plot
EFFICIENT_NOTE = "assumed: torch's memory-efficient kernel at 0.7x the flash kernel's fraction"


def scaled(curve: Efficiency, factor: float, source: str) -> Efficiency:
    return Efficiency(tuple((x, f * factor) for x, f in curve.points), source)


def attention(fwd: Efficiency, bwd: Efficiency) -> dict[str, Efficiency]:
    return {
        "flash_fwd": fwd,
        "flash_bwd": bwd,
        "efficient_fwd": scaled(fwd, 0.7, EFFICIENT_NOTE),
        "efficient_bwd": scaled(bwd, 0.7, EFFICIENT_NOTE),
    }


# -- memory-bound kernels --------------------------------------------------------------------------
#: ~90% of the HBM datasheet rate for large copies; small kernels do not fill the memory system
HBM = Efficiency(
    ((2.0**20, 0.30), (2.0**23, 0.70), (2.0**26, 0.90)),
    "STREAM-style copy/triad on H100 SXM: ~3.0-3.1 TB/s of 3.35 (0.90); the ramp below 64 MiB assumed "
    "(a kernel needs a few microseconds of traffic to fill the memory system)",
)

# -- collectives -------------------------------------------------------------------------------------
NCCL_TESTS = (
    "nccl-tests all_reduce_perf busbw at large sizes (Alaya 'NCCL-tests in practice', 2026): 8xH100 SXM "
    "460-480 GB/s, 8xA100 SXM 230-250 GB/s, 8xH100 PCIe 35-45 GB/s"
)


def collectives(all_reduce: float, others: float, source: str, **override: float) -> dict[str, Efficiency]:
    """Bus-bandwidth fraction per collective: all-reduce as measured, the others at ``others``."""
    out = {}
    for name in COLLECTIVES:
        frac = override.get(name, all_reduce if name == "all_reduce" else others)
        why = source if name == "all_reduce" else f"{source}; {name} assumed at {frac:.2f} of the link"
        out[name] = flat(frac, why)
    return out


NVLINK3 = collectives(0.80, 0.80, NCCL_TESTS + " -> A100 0.80 of 300 GB/s")
#: NVLink SHARP (NVLS) reduces inside the switch: all-reduce busbw above the one-way link rate
NVLINK4 = collectives(1.0, 0.80, NCCL_TESTS + " -> H100 1.0 of 450 GB/s (NVLS)")
PCIE = collectives(0.60, 0.60, NCCL_TESTS + " -> PCIe Gen5 0.6 of 64 GB/s")
XGMI = collectives(0.70, 0.70, "assumed: RCCL on MI300X's xGMI mesh at 0.7 (no rccl-tests figure at hand)")
NETWORK = collectives(
    0.85,
    0.85,
    "a NIC's share of a multi-node ring at 0.85 of line rate: the middle of the 0.77-1.0 NIC efficiency "
    "torch._inductor.comm_analysis calibrated on H100 RoCE clusters",
)

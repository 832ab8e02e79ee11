"""One kernel's seconds on a :class:`~composable_atorch.hardware.Hardware`, from its FLOPs and bytes.

The rules, each stated once (the figures they read carry their sources in the catalog):

* GEMM: the roofline of NVIDIA's Matrix Multiplication Background guide, ``max(FLOPs / (peak x
  efficiency), bytes / (memory bandwidth x memory efficiency))``, at the dtype's dense peak (fp32
  at the fp32 rate: torch leaves TF32 off for matmuls) and the catalog's GEMM efficiency (the MAMF
  ceiling); tile and wave quantization are not modelled.
* attention: the flash kernel for bf16 / fp16 without an explicit mask (torch SDPA's choice), the
  memory-efficient kernel otherwise, at the catalog's fraction of the dtype's peak against the key
  length. A causal call does half the work (FlashAttention's convention: the published fractions
  count causal FLOPs halved). The backward is counted as FlashAttention's benchmarks count it, 2.5
  forwards (the scores recomputed), as torch's flop counter does.
* memory-bound kernels: bytes moved at the memory bandwidth times the memory curve.
* every kernel costs at least the device's launch floor; what a kernel spends below it is reported
  as overhead.
"""

from __future__ import annotations

from composable_atorch.hardware import Hardware

HALF = ("bfloat16", "float16")


def kernel(hw: Hardware, work: float) -> tuple[float, float]:
    """``(seconds, seconds of work)``: the work, lifted to the launch floor."""
    return max(work, hw.launch_s), work


def memory_s(hw: Hardware, nbytes: float) -> float:
    return nbytes / (hw.memory_bandwidth * hw.memory(nbytes)) if nbytes > 0 else 0.0


def gemm(hw: Hardware, dtype: str, flops: float, nbytes: float) -> tuple[float, float]:
    dtype = dtype if dtype in ("float32", *HALF, "float8") else "float32"
    rate = hw.peak(dtype) * hw.gemm_efficiency(dtype, flops)
    return kernel(hw, max(flops / rate, memory_s(hw, nbytes)))


def attention(
    hw: Hardware, dtype: str, flops: float, *, backward: bool, causal: bool, seq: int, mask: bool, nbytes: float = 0.0
) -> tuple[float, float]:
    name = "flash" if dtype in HALF and not mask else "efficient"
    frac = hw.attention[f"{name}_{'bwd' if backward else 'fwd'}"](max(seq, 1))
    work = flops * (0.5 if causal else 1.0)
    peak = hw.peak(dtype if dtype in HALF else "float32")
    return kernel(hw, max(work / (peak * frac), memory_s(hw, nbytes)))


def memory(hw: Hardware, nbytes: float) -> tuple[float, float]:
    return kernel(hw, memory_s(hw, nbytes))


def compute_op(hw: Hardware, ev) -> tuple[float, float]:
    """``(seconds, seconds of work)`` of one compute :class:`~.trace.Event`."""
    if ev.kind == "mm":
        return gemm(hw, ev.dtype, ev.size, ev.nbytes)
    if ev.kind in ("sdpa", "sdpa_bwd"):
        return attention(
            hw,
            ev.dtype,
            ev.size,
            backward=ev.kind == "sdpa_bwd",
            causal=ev.causal,
            seq=ev.seq,
            mask=ev.mask,
            nbytes=ev.nbytes,
        )
    return memory(hw, ev.size)

"""A pipeline schedule's bubble: the idle time its published analysis gives, per schedule.

``F``, ``B`` and ``W`` are one micro-batch's forward, full backward and weight-gradient part of the
backward on one rank (all its stages); a rank holding ``v`` stages runs chunks of ``1/v`` of that.
``p`` ranks in the pipeline, ``m`` micro-batches.

* GPipe, 1F1B (Narayanan et al., "PipeDream-Flush", arXiv 2006.09503; Megatron-LM, arXiv 2104.04473):
  ``(p - 1)(F + B)``, i.e. ``(p - 1) / m`` of the busy time;
* interleaved 1F1B / looped BFS with ``v`` stages per rank (Megatron-LM, arXiv 2104.04473 sec. 2.2):
  ``(p - 1)(F + B) / v``;
* zero bubble ZB-H1 (Qi et al., arXiv 2401.10241; "ZB1P" in DeepSeek's DualPipe table):
  ``(p - 1)(F + B - 2W)`` per chunk; the interleaved and V-shaped variants torch runs
  (InterleavedZeroBubble, ZBVZeroBubble) with chunks of ``1/v``;
* DualPipeV (DeepSeek-V3 report, arXiv 2412.19437; table of github.com/deepseek-ai/DualPipe):
  ``(PP/2 - 1)(F&B + B - 3W)`` with ``PP = 2p`` stages of half a rank's layers, ``F&B`` an
  overlapped forward and backward (here not overlapped: ``F + B``).

``W`` is taken as half the backward's GEMM time (a Linear's weight gradient and input gradient
are GEMMs of equal FLOPs). A bubble never goes below zero.
"""

from __future__ import annotations

from dataclasses import dataclass

SINGLE = ("GPipe", "1F1B")
INTERLEAVED = ("Interleaved1F1B", "LoopedBFS")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
DUAL = ("DualPipeV",)
SCHEDULES = SINGLE + INTERLEAVED + ZERO_BUBBLE + DUAL


@dataclass(frozen=True)
class Chunks:
    """One micro-batch's seconds on one rank: forward, full backward, weight-gradient part."""

    forward: float
    backward: float
    weight: float


def bubble(schedule: str, p: int, v: int, c: Chunks) -> float:
    """Idle seconds per step of ``schedule`` over ``p`` ranks with ``v`` stages per rank."""
    if p <= 1:
        return 0.0
    v = max(1, v)
    f, b, w = c.forward / v, c.backward / v, c.weight / v
    if schedule in SINGLE:
        idle = (p - 1) * (c.forward + c.backward)
    elif schedule in INTERLEAVED:
        idle = (p - 1) * (f + b)
    elif schedule in ZERO_BUBBLE:
        idle = (p - 1) * (f + b - 2 * w)
    elif schedule in DUAL:
        idle = (p - 1) * ((f + b) + b - 3 * w)
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    return max(0.0, idle)

"""The step on a compute stream and communication streams, as a GPU overlaps them.

Each priced op is a :class:`Slot`: a compute kernel (seconds, of which ``work`` is above the launch
floor), a collective with its overlap :data:`policy <POLICIES>`, or the optimizer's barrier. The
compute stream runs kernels back to back. Collectives run on three streams, as torch issues them:
parameter all-gathers on one (FSDP's all-gather stream), gradient reductions on another (FSDP's
reduce-scatter stream, DDP's reducer), the collectives the compute waits for at once on a third;
each runs its collectives one at a time in issue order. Streams running side by side are not
charged for sharing the links (NVLink and the NICs are full duplex; an all-gather and a
reduce-scatter move data both ways at once). What the
compute stream waits for is *exposed* communication; the rest is hidden under compute, but not for
free: compute that runs while a collective is in flight is slowed, NCCL's kernels taking SMs and
memory bandwidth from it (:data:`CONTENTION`), and that slowdown is exposed communication too.

Policies (which transform issues what is decided by the caller, :mod:`.price`):

* ``prefetch`` (FSDP's parameter all-gathers): may start as soon as the compute segment before it
  started (one block ahead); the compute after it waits for it.
* ``async`` (gradient reduce-scatters, DDP's bucket all-reduces, a pipeline's sends): starts when
  issued, nothing waits for it until the optimizer's barrier.
* ``blocking`` (tensor-parallel, expert and Ulysses collectives, a pipeline's receives, anything
  after the barrier): the compute after it waits for it.
* ``next`` (the ring attention's sends and receives): starts when issued and overlaps the compute
  after it; the compute after the *next* collective waits for it (the block it carries is used one
  step later).
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("prefetch", "async", "blocking", "next")
#: how much longer compute takes while a collective runs beside it: 18.9% on average (40% at most)
#: over GEMM / attention kernels overlapped with NCCL collectives on A100, H100, MI250 and MI210
#: (Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
#: Learning", arXiv 2507.03114, 2025) -- a kernel-level measurement, not a training table
CONTENTION = 0.189
#: the communication stream each policy's collectives run on
STREAM = {"prefetch": "gather", "async": "reduce", "blocking": "sync", "next": "sync"}


@dataclass(frozen=True, slots=True)
class Slot:
    """One priced op: ``kind`` "compute", "comm" or "barrier"."""

    kind: str
    seconds: float = 0.0
    work: float = 0.0
    policy: str = "blocking"
    backward: bool = False
    optimizer: bool = False


@dataclass(frozen=True)
class Timeline:
    """Seconds of one simulated step on one rank."""

    total: float
    compute: float  # kernels' work on the compute stream
    overhead: float  # what kernels spend below the launch floor
    exposed: float  # compute stream waiting for communication, or slowed by it (CONTENTION)
    comm: float  # all communication seconds, hidden or not
    forward: float  # compute seconds of the forward (and of the backward, the optimizer): the
    backward: float  # pipeline bubble formulas read them per micro-batch
    optimizer: float


def run(slots: list[Slot], contention: float = CONTENTION) -> Timeline:
    """Lay ``slots`` on the streams (see the module doc); ``contention``: the compute slowdown while a
    collective is in flight, charged on the overlapped seconds (to first order: the collectives keep
    the start times the unslowed compute gives them)."""
    t = wait = 0.0
    computing: list[tuple[float, float]] = []
    communicating: list[tuple[float, float]] = []
    free = dict.fromkeys(set(STREAM.values()), 0.0)
    seg_start, new_segment = 0.0, True
    pending: list[float] = []
    deferred: list[float] = []  # "next" collectives: waited for after the next collective
    exposed = work = busy = comm = fwd = bwd = opt = 0.0
    for s in slots:
        if s.kind == "compute":
            if wait > t:
                exposed += wait - t
                t = wait
            if new_segment:
                seg_start, new_segment = t, False
            computing.append((t, t + s.seconds))
            t += s.seconds
            busy += s.seconds
            work += s.work
            if s.optimizer:
                opt += s.seconds
            elif s.backward:
                bwd += s.seconds
            else:
                fwd += s.seconds
        elif s.kind == "comm":
            comm += s.seconds
            if deferred:
                wait = max(wait, *deferred)
                deferred = []
            stream = STREAM[s.policy]
            end = max(free[stream], seg_start if s.policy == "prefetch" else t) + s.seconds
            free[stream] = end
            communicating.append((end - s.seconds, end))
            if s.policy == "async":
                pending.append(end)
            elif s.policy == "next":
                deferred.append(end)
            else:
                wait = max(wait, end)
            new_segment = True
        else:  # the optimizer's barrier: every reduction in flight must be done
            wait = max([wait, *pending, *deferred])
            pending, deferred, new_segment = [], [], True
    end = max(t, wait, *free.values(), *pending, *deferred)
    exposed += end - t
    slowed = contention * overlap(computing, communicating)
    return Timeline(end + slowed, work, busy - work, exposed + slowed, comm, fwd, bwd, opt)


def overlap(computing: list[tuple[float, float]], communicating: list[tuple[float, float]]) -> float:
    """Seconds during which the compute stream runs while at least one collective is in flight
    (``computing``: back-to-back intervals in order; ``communicating``: any intervals)."""
    merged: list[list[float]] = []
    for a, b in sorted(c for c in communicating if c[1] > c[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total, k = 0.0, 0
    for a, b in computing:
        while k < len(merged) and merged[k][1] <= a:
            k += 1
        j = k
        while j < len(merged) and merged[j][0] < b:
            total += min(b, merged[j][1]) - max(a, merged[j][0])
            j += 1
    return total

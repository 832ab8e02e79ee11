"""The step on a compute stream and communication streams, as a GPU overlaps them.

Each priced op is a :class:`Slot`: a compute kernel (seconds, of which ``work`` is above the launch
floor), a collective with its overlap :data:`policy <POLICIES>`, or the optimizer's barrier. The
compute stream runs kernels back to back. Collectives run on three streams, as torch issues them:
parameter all-gathers on one (FSDP's all-gather stream), gradient reductions on another (FSDP's
reduce-scatter stream, DDP's reducer), the collectives the compute waits for at once on a third;
each runs its collectives one at a time in issue order. Streams running side by side are not
charged for sharing the links (NVLink and the NICs are full duplex; an all-gather and a
reduce-scatter move data both ways at once). What the
compute stream waits for is *exposed* communication; the rest is hidden under compute.

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
    exposed: float  # compute stream waiting for communication
    comm: float  # all communication seconds, hidden or not
    forward: float  # compute seconds of the forward (and of the backward, the optimizer): the
    backward: float  # pipeline bubble formulas read them per micro-batch
    optimizer: float


def run(slots: list[Slot]) -> Timeline:
    """Lay ``slots`` on the two streams (see the module doc)."""
    t = wait = 0.0
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
    return Timeline(end, work, busy - work, exposed, comm, fwd, bwd, opt)

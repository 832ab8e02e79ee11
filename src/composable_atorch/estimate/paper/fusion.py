"""torch.compile's effect on the priced step, as one stated rule (not fitted to any measurement).

Inductor fuses the pointwise and reduction ops between two "anchors" it does not fuse (GEMMs,
attention, collectives) into generated kernels that read their inputs once and write their outputs
once (Ansel et al., "PyTorch 2", ASPLOS 2024, sec. 5). So under compile, in the forward and the
backward (the optimizer step is not compiled by ``compile()``), each run of memory-bound ops between
two anchors becomes one kernel, launched once, moving the bytes the run reads that it did not write
itself, plus the bytes it writes that it does not read again itself (those may be read later). The
FLOPs and every GEMM, attention call and collective stay as they are.
"""

from __future__ import annotations

from composable_atorch.estimate.paper.trace import Event


def fuse(events: list[Event]) -> list[Event]:
    """``events`` with each fusible run of memory ops merged into one (see the module doc)."""
    out: list[Event] = []
    run: list[Event] = []
    after_barrier = False
    for ev in events:
        if ev.kind == "barrier":
            out += _merged(run)
            run = []
            after_barrier = True
            out.append(ev)
        elif ev.kind == "memory" and not after_barrier and ev.reads + ev.writes:
            if run and run[-1].backward != ev.backward:
                out += _merged(run)
                run = []
            run.append(ev)
        else:
            out += _merged(run)
            run = []
            out.append(ev)
    return out + _merged(run)


def _merged(run: list[Event]) -> list[Event]:
    if len(run) <= 1:
        return run
    written: dict[int, float] = {}
    read_inside: set[int] = set()
    external: dict[int, float] = {}
    for ev in run:
        for t, nbytes in ev.reads:
            if t not in written:
                external[t] = nbytes
            read_inside.add(t)
        written.update(ev.writes)
    outputs = sum(nbytes for t, nbytes in written.items() if t not in read_inside)
    first = run[0]
    return [Event("memory", first.dtype, sum(external.values()) + outputs, backward=first.backward)]

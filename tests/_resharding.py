"""One training run in phases at different plans and worlds, each phase resuming the previous one's
checkpoint (tests/state/test_reshard_*.py): the phases run in as few spawned groups as their order
allows (a group costs seconds to start), one process without a process group for world 1."""

from __future__ import annotations

from _dist import run_world


def rounds(cases: dict[str, list[tuple]]) -> list[tuple[int, list[tuple[str, int]]]]:
    """``[(world, [(case, phase index), ...]), ...]``: each round runs, at one world, every case's next
    phases at that world (consecutive ones in one round); a phase runs after its case's previous one.
    A case's phase is ``(world, ...)``."""
    done = {case: 0 for case in cases}
    out = []
    while any(done[c] < len(p) for c, p in cases.items()):
        ready = [p[done[c]][0] for c, p in cases.items() if done[c] < len(p)]
        world = 1 if 1 in ready else max(sorted(set(ready)), key=ready.count)
        work = []
        for case, phases in cases.items():
            while done[case] < len(phases) and phases[done[case]][0] == world:
                work.append((case, done[case]))
                done[case] += 1
        out.append((world, work))
    return out


def run_all(cases: dict[str, list[tuple]], fn, *args, timeout: int = 600) -> dict:
    """``fn(rank, world, work, *args)`` -> ``{key: value}`` for every round; ``{key: [value of each rank]}``."""
    out: dict = {}
    for world, work in rounds(cases):
        per_rank = [fn(0, 1, work, *args)] if world == 1 else run_world(fn, world, work, *args, timeout=timeout)
        for key in per_rank[0]:
            out[key] = [r[key] for r in per_rank]
    return out

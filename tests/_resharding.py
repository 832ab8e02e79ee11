"""One training run in phases at different plans and worlds, each phase resuming the previous one's
checkpoint (tests/state/: test_reshard_*, test_elastic_resume, test_open_anywhere), compared with one
process on the run's global order: each step's sample ids exactly, its loss and the final weights.
The phases run in as few spawned groups as their order allows, one process without a process group
for world 1."""

from __future__ import annotations

import torch

import equivalence as eq

from _dist import run_world


class Indexed(torch.utils.data.Dataset):
    """Sample ``i`` is ``(i, tokens of i)`` (``length`` ids in ``[low, vocab)``, seeded by ``i``), or with
    ``shifted`` ``(i, inputs, targets)`` of ``length + 1`` ids: every batch says which samples it holds."""

    def __init__(self, samples: int, length: int, vocab: int, low: int = 0, shifted: bool = False):
        self.samples, self.length, self.vocab, self.low, self.shifted = samples, length, vocab, low, shifted

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        tokens = torch.randint(self.low, self.vocab, (self.length + self.shifted,), generator=g)
        return (i, tokens[:-1], tokens[1:]) if self.shifted else (i, tokens)


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


# -- one phase of a run, and the run's global order (what every test_reshard_* phase does) --------


def global_order(dataset, epoch: int) -> list[int]:
    """The run's sample order in ``epoch``: a DistributedSampler of seed 0 at data 1 (the plan's order)."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def global_batches(dataset, batch: int, steps: int) -> list[list[int]]:
    """The sample ids of each of the run's first ``steps`` global batches (``batch`` at a time, across epochs)."""
    out = []
    for step in range(steps):
        order = global_order(dataset, step * batch // len(dataset))
        start = step * batch % len(dataset)
        out.append(order[start : start + batch])
    return out


def one_process_loader(dataset, batch: int):
    """No plan: the run's global order read by the user's own sampler (the plan's order at data 1)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from composable_atorch.runtime.resumable import resumable

    return resumable(
        DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, 1, 0, shuffle=True, seed=0))
    )


def reference_run(model, optim, dataset, batch: int, total: int, inputs, loss_fn, scheduler=None):
    """One process, plain torch, on the run's first ``total`` global batches (``inputs(collated samples)
    -> (x, y)``): ``(losses, sorted sample ids per step, final weights as numpy)``."""
    from torch.utils.data import default_collate

    steps = global_batches(dataset, batch, total)
    batches = [inputs(default_collate([dataset[i] for i in ids])) for ids in steps]
    params, losses = eq.reference(model, optim, batches, loss_fn, scheduler=scheduler)
    return losses, [sorted(ids) for ids in steps], eq.plain(params)


def train_phase(model, optim, data, where: str, first: int, last: int, step_fn, **load) -> list[tuple]:
    """Load the previous phase's checkpoint from ``where`` (unless ``first`` is 1; ``load``: load_state's
    keywords) and train to step ``last``: ``step_fn(batch)`` trains one batch and returns what to
    record of it; the records are ``(step, *step_fn(batch))``. The caller saves."""
    import composable_atorch as ca

    step = 0
    if first > 1:
        resumed = ca.load_state(where, model, optim, data, verbose=False, **load)
        assert resumed.step == first - 1 and resumed.data_position_carried, resumed.explain()
        step = resumed.step
    epoch, record = data.epoch, []
    while step < last:
        data.sampler.set_epoch(epoch)
        for batch in data:
            step += 1
            record.append((step, *step_fn(batch)))
            if step >= last:
                break
        epoch += 1
    return record

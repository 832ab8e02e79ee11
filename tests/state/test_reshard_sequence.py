"""A run split along the sequence resumes at another context degree, plan and world: every sample once.

Context parallelism (``("context", 2)``) and Ulysses (``("sequence", 2)``) give every rank of a
sequence group the *same* samples (half of each sequence): the data position a checkpoint carries is
the global samples consumed, read from the data dimension alone, so a resume under context 1 (ddp,
fsdp, or no plan in one process) and back, or at context 2 x data 2 at world 4, neither repeats nor
skips a sample. Each run is compared with one plain process on the run's global order (a
DistributedSampler of seed 0 read ``BATCH`` at a time): each step's sample ids exactly, its loss and
the final weights to fp32 reduction order, SGD and AdamW (moments resharded too).

A case is one training run in phases; each phase loads the previous one's checkpoint, trains and
saves. They run in three spawned groups (world 2, world 4, world 2) and this process (no process
group: ``cp``'s one-process phase), see _resharding.py.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from torch.utils.data import DataLoader

import composable_atorch as ca
import equivalence as eq
from _resharding import Indexed, one_process_loader, reference_run, run_all, train_phase
from zoo.sequence import user_lm

SEQ, SAMPLES, BATCH, TOTAL = 16, 16, 4, 6  # 4 steps per epoch: the run crosses into epoch 1
OPTIMIZERS = eq.EXPERT
PLANS = {
    "context": lambda: ca.compose(ca.parallel_mode([("context", 2)]), ca.context_parallel()),
    "context_data": lambda: ca.compose(ca.parallel_mode([("context", 2), ("data", 2)]), ca.context_parallel()),
    "context_fsdp": lambda: ca.compose(
        ca.parallel_mode([("context", 2), ("data", 2)]), ca.context_parallel(), ca.fsdp()
    ),
    "ulysses": lambda: ca.compose(ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel()),
    "ddp": lambda: ca.compose(ca.ddp()),
    "fsdp": lambda: ca.compose(ca.fsdp()),
    "plain": None,  # no plan, one process, no process group
}
#: case -> [(world, plan, first step, last step)]: each phase saves at its last step, the next loads it
PHASES = {
    "cp": [(2, "context", 1, 2), (1, "plain", 3, 4), (2, "context", 5, 6)],
    "sp": [(2, "ulysses", 1, 2), (2, "fsdp", 3, 4), (2, "ulysses", 5, 6)],
    "dp": [(2, "ddp", 1, 2), (2, "context", 3, 4), (4, "context_data", 5, 6)],
    "wide": [(4, "context_fsdp", 1, 3), (2, "ulysses", 4, 6)],
}


def dataset():
    return Indexed(SAMPLES, SEQ, 256, shifted=True)


def model():
    return user_lm(d=16, heads=2, layers=2, max_len=SEQ)


loss_fn = eq.token_ce


def loader():
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


def reference(opt: str):
    """One process, plain torch, on the run's global batches: (losses, ids per step, final weights)."""
    m = model()
    return reference_run(m, OPTIMIZERS[opt](m.parameters()), dataset(), BATCH, TOTAL, lambda b: (b[1], b[2]), loss_fn)


def run_phase(case: str, opt: str, directory: str, plan_name: str, first: int, last: int) -> dict:
    """Apply the phase's plan, load the previous phase's checkpoint, train to ``last``, save."""
    m = model()
    optim = OPTIMIZERS[opt](m.parameters())
    if PLANS[plan_name] is None:
        data = one_process_loader(dataset(), BATCH)
    else:
        m, optim, data = PLANS[plan_name]()(m, optim, loader())
    where = f"{directory}/{case}-{opt}"

    def train(batch):
        ids, x, y = batch
        return ca.train_step(m, optim, x, y, loss_fn), ids.tolist(), tuple(x.shape)

    record = train_phase(m, optim, data, where, first, last, train)
    ca.save_state(where, m, optim, data, step=last)
    return {"record": record, "params": eq.plain(eq.full_params(m))}


def group(rank, world, work, directory):
    return {
        (case, index, opt): run_phase(case, opt, directory, *PHASES[case][index][1:])
        for case, index in work
        for opt in OPTIMIZERS
    }


@pytest.mark.dist
def test_sequence_split_runs_resume_at_other_context_degrees_with_every_sample_once(tmp_path):
    results = run_all(PHASES, group, str(tmp_path))  # (case, phase index, opt) -> per-rank results

    for opt in OPTIMIZERS:
        ref_losses, ref_ids, ref_params = reference(opt)
        for case, phases in PHASES.items():
            steps, params = [], None
            for index, (world, plan, _, _) in enumerate(phases):
                per_rank = results[(case, index, opt)]
                assert len(per_rank) == world, (case, plan)
                split = 2 if plan.startswith(("context", "ulysses")) else 1  # ranks sharing each sample
                for i in range(len(per_rank[0]["record"])):
                    step = per_rank[0]["record"][i][0]
                    seen = collections.Counter(x for r in per_rank for x in r["record"][i][2])
                    # each sample read by exactly the ranks that split its sequence, half a sequence each
                    assert set(seen.values()) == {split}, (case, opt, plan, step, seen)
                    assert {r["record"][i][3][1] for r in per_rank} == {SEQ // split}, (case, plan)
                    loss = float(np.mean([r["record"][i][1] for r in per_rank]))
                    steps.append((step, loss, sorted(seen)))
                params = per_rank[0]["params"]
            assert [s for s, _, _ in steps] == list(range(1, TOTAL + 1)), case
            # no sample skipped or repeated across the resumes: each step's batch is the uninterrupted run's
            assert [ids for _, _, ids in steps] == ref_ids, (case, opt)
            gaps = [abs(loss - ref) for (_, loss, _), ref in zip(steps, ref_losses, strict=True)]
            assert max(gaps) < 1e-4, (case, opt, gaps)
            worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
            assert worst < 1e-4, (case, opt, worst)

"""estimate's per-rank peak against the measured peak for the transformers-5 MoE families and Llama.

One process (world 1, no plan steps that split the model): the measured peak is torch's MemTracker
over one training step after two warm-up steps (auto.worker.peak_bytes_of_step, as the estimate tests
measure); the estimate is composable_atorch.estimate on fake tensors. Expert degrees are in
benchmarks/estimate_expert.py.

World 2 (``world2`` rows): context 2 (all-gather and ring rotations) and Ulysses 2 on the Llama and
the plain user model of tests/_seq.py at sequence 64 and 256, batch 2: each rank's MemTracker peak
of a real gloo world-2 run (after two warm-up steps) against the estimate of that rank. Writes
benchmarks/results/estimate_sequence_expert.json and prints both tables.

    PYTHONPATH=src python benchmarks/estimate_sequence_expert.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "estimate"))

import _seq  # noqa: E402
from composable_atorch import compose  # noqa: E402
from composable_atorch.auto.worker import peak_bytes_of_step  # noqa: E402
from composable_atorch.estimate.core import estimate  # noqa: E402
from zoo import moe as mm  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def hf_loss(model, batch):
    return model(**batch).loss


def adamw(model):
    return torch.optim.AdamW(model.parameters())


def measured(build, ids) -> int:
    torch.manual_seed(0)
    model = build()
    optim = adamw(model)

    def step(before_micro=None):
        if before_micro is not None:
            before_micro()
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()

    step()
    step()
    return peak_bytes_of_step(step, model, optim, "cpu")[0]


def predicted(build, shape) -> int:
    batch = {"input_ids": shape, "labels": shape}
    return estimate(compose(), build, batch, world_size=1, loss_fn=hf_loss, optimizer=adamw, step_time=False).peak


def rows():
    for name in FAMILIES:
        ids = mm.batch(0, 4)
        yield (
            name,
            tuple(ids.shape),
            measured(lambda n=name: mm.build(n), ids),
            predicted(lambda n=name: mm.build(n), tuple(ids.shape)),
        )
    for seq in (64, 256):
        ids = torch.randint(1, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
        yield f"llama seq {seq}", tuple(ids.shape), measured(_seq.llama, ids), predicted(_seq.llama, tuple(ids.shape))


def world2_rows():
    """``(model, seq, split, [measured per rank], [estimate per rank])`` of the gloo world-2 runs."""
    import test_estimate_sequence_split as seqsplit

    from _dist import run_world

    cases = [(seqsplit.plan_json(k), m, s) for m, s, k in seqsplit.CASES]
    measured = run_world(seqsplit._measure_all, 2, cases, timeout=1800)
    for i, (text, m, seq) in enumerate(cases):
        est = seqsplit.predict(text, m, seq, step_time=False)
        yield m, seq, seqsplit.kind_of(text), [peaks[i] for peaks in measured], [r.peak for r in est.ranks]


def main():
    table = []
    print(f"{'model':16s} {'batch':10s} {'measured':>10s} {'estimate':>10s} {'ratio':>6s}")
    for name, shape, peak, est in rows():
        table.append({"model": name, "batch": list(shape), "measured": peak, "estimate": est, "ratio": est / peak})
        print(f"{name:16s} {str(shape):10s} {peak:10d} {est:10d} {est / peak:6.3f}", flush=True)
    world2 = []
    print(
        f"\nworld 2 (gloo), batch 2\n{'model':6s} {'seq':>4s} {'split':8s} {'rank':>4s} {'measured':>10s} "
        f"{'estimate':>10s} {'ratio':>6s}"
    )
    for m, seq, split, peaks, ests in world2_rows():
        for rank, (peak, est) in enumerate(zip(peaks, ests, strict=True)):
            world2.append(
                {
                    "model": m,
                    "seq": seq,
                    "split": split,
                    "rank": rank,
                    "measured": peak,
                    "estimate": est,
                    "ratio": est / peak,
                }
            )
            print(f"{m:6s} {seq:4d} {split:8s} {rank:4d} {peak:10d} {est:10d} {est / peak:6.3f}", flush=True)
    out = os.path.join(HERE, "results", "estimate_sequence_expert.json")
    with open(out, "w") as f:
        json.dump({"world": 1, "device": "cpu", "rows": table, "world2": world2}, f, indent=1)


if __name__ == "__main__":
    main()

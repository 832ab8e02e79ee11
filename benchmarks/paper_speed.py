"""How long one estimate on paper takes: Llama-2-7B plans of every layout family at 8 and 64 GPUs.

    python benchmarks/paper_speed.py [--worlds 8 64] [--plans fsdp hybrid ...]

The search on paper prices dozens of plans in one run, each with one ``estimate(...)`` call, so this
is what it waits for. Each row is one call in this process (the model's modules imported once,
before the first row): Llama-2-7B (``--model llama-7b``'s shape), sequence 4096, 4 samples per GPU,
bf16 autocast, every decoder layer checkpointed (fsdp-compile: and compiled), AdamW, priced on
``a100-80gb-sxm``. The notes say how each was simulated (the blocks and micro-steps simulated,
extrapolated per block / micro-step).
Writes benchmarks/results/paper_speed.json. Times are wall seconds on this shared 2-core machine:
compare rows of one run, not runs of different days (each row records the 1-minute load average).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

RESULTS = Path(__file__).parent / "results" / "paper_speed.json"
SEQ, PER_GPU = 4096, 4
PLANS = ("fsdp", "fsdp-selective", "fsdp-compile", "hybrid", "tensor-data", "pipeline", "tensor-pipeline", "context")


def plan(kind: str, world: int):
    """The plan, and the data-parallel size the global batch is counted over (4 samples per GPU)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer

    import composable_atorch as ca
    from composable_atorch.environment import Environment

    env = Environment.detect().with_(world_size=world, device="cuda", compute_capability=(8, 0))
    policy = {"policy": "selective"} if kind == "fsdp-selective" else {}
    tail = [ca.amp("bf16"), ca.checkpoint(Layer, **policy)]
    if kind == "fsdp-compile":
        tail.append(ca.compile())
    parts = {
        "fsdp": [ca.fsdp(wrap=Layer)],
        "fsdp-selective": [ca.fsdp(wrap=Layer)],
        "fsdp-compile": [ca.fsdp(wrap=Layer)],
        "hybrid": [ca.parallel_mode([("zero", 8), ("data", world // 8)]), ca.fsdp(wrap=Layer)],
        "tensor-data": [
            ca.parallel_mode([("tensor", 8), ("data", world // 8)]),
            ca.tensor_parallel(),
            ca.fsdp(wrap=Layer),
        ],
        # 4 samples per GPU: 16 per pipeline of 4, as 16 micro-batches of 1
        "pipeline": [ca.mixed_parallel(pipeline=4, microbatches=16)],
        "tensor-pipeline": [ca.mixed_parallel(tensor=2, pipeline=2, microbatches=16)],
        "context": [
            ca.parallel_mode([("context", 2), ("data", world // 2)]),
            ca.context_parallel(),
            ca.fsdp(wrap=Layer),
        ],
    }[kind]
    return ca.compose(*parts, *tail, env=env)


def criterion(output, targets):
    import torch

    logits = output.logits if hasattr(output, "logits") else output
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def row(kind: str, world: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from composable_atorch.cli.estimate import LLAMA_7B
    from composable_atorch.estimate import estimate

    config = LlamaConfig(**LLAMA_7B)
    shape = torch.Size([PER_GPU * world, SEQ])
    pairs = kind in ("pipeline", "tensor-pipeline", "context")  # (tokens, targets): the schedule's / split's loss
    t0 = time.perf_counter()
    est = estimate(
        plan(kind, world),
        lambda: AutoModelForCausalLM.from_config(config),
        (shape, shape) if pairs else {"input_ids": shape, "labels": shape},
        world_size=world,
        device="cuda",
        hardware="a100-80gb-sxm",
        criterion=criterion if pairs else None,
    )
    seconds = time.perf_counter() - t0
    load = os.getloadavg()[0]
    how = [n for n in est.notes if "simulated with" in n or "whole model" in n or "micro-steps" in n]
    return {
        "plan": kind,
        "world": world,
        "estimate_s": seconds,
        "load_average_1min": load,
        "step_time_s": est.step_time_s,
        "tokens_per_s_per_device": est.tokens_per_s_per_device,
        "mfu": est.mfu,
        "peak_gib": est.peak / 2**30,
        "how": how,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--plans", nargs="*", default=list(PLANS), choices=PLANS)
    args = parser.parse_args(argv)
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported once, outside the timings

    rows = []
    print(f"{'plan':16} {'GPUs':>4} {'estimate s':>10} {'step s':>8} {'MFU':>6} {'peak GiB':>8}  how")
    for world in args.worlds:
        for kind in args.plans:
            r = row(kind, world)
            rows.append(r)
            print(
                f"{kind:16} {world:4} {r['estimate_s']:10.1f} {r['step_time_s']:8.3f} {r['mfu']:6.3f} "
                f"{r['peak_gib']:8.1f}  {' / '.join(r['how'])[:150]}",
                flush=True,
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count()
    RESULTS.write_text(json.dumps({"assumptions": __doc__, "cpus": cpus, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

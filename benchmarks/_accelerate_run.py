"""HF Accelerate on the benchmark's user model, run under torchrun (one process per rank):

    torchrun --nproc_per_node 2 benchmarks/_accelerate_run.py --mixed-precision no|bf16 --steps 10 --out f.json

``Accelerator()`` is what an Accelerate user writes with no effort (fp32 DDP here), and
``Accelerator(mixed_precision="bf16")`` the one flag. Same model, data, optimizer and global batch
as benchmarks/steptime.py; rank 0 writes the per-step seconds (after warm-up) as JSON.
(``accelerate launch --cpu --num_processes 2`` silently runs one process: torchrun is used instead.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", action="store_true", help="the small variant of the model (_usergpt.SMALL)")
    args = parser.parse_args()

    import _usergpt as g
    import torch
    from accelerate import Accelerator

    torch.set_num_threads(1)  # as the library's trial workers: one thread per rank
    accelerator = Accelerator() if args.mixed_precision == "no" else Accelerator(mixed_precision=args.mixed_precision)
    torch.manual_seed(0)
    model_fn, data = g.builders(args.small)
    model = model_fn()
    optim = g.optim_fn(model)
    per_rank = g.GLOBAL_BATCH // accelerator.num_processes
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank, shuffle=False, drop_last=True)
    model, optim, loader = accelerator.prepare(model, optim, loader)

    def endless():  # as the library's trial workers: a new epoch when the loader ends
        while True:
            yield from loader

    batches = endless()
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()  # the batch's fetch is timed, as in the library's trials (~0.05 ms here)
        tokens, targets = next(batches)
        loss = g.criterion(model(tokens), targets)
        accelerator.backward(loss)
        optim.step()
        optim.zero_grad()
        loss.item()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "step_times": times,
                    "processes": accelerator.num_processes,
                    "state": str(accelerator.distributed_type),
                },
                f,
            )


if __name__ == "__main__":
    main()

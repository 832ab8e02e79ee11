"""HF Accelerate on the benchmark's user model, run under torchrun (one process per rank):

    torchrun --nproc_per_node 2 benchmarks/_accelerate_run.py --mixed-precision no|bf16 --steps 10 --out f.json
    torchrun --nproc_per_node 2 benchmarks/_accelerate_run.py --mixed-precision bf16 --versus ddp+amp --out f.json

``Accelerator()`` is what an Accelerate user writes with no effort (fp32 DDP here), and
``Accelerator(mixed_precision="bf16")`` the one flag. Same model, data, optimizer and global batch
as benchmarks/steptime.py; rank 0 writes the per-step seconds (after warm-up) as JSON.
(``accelerate launch --cpu --num_processes 2`` silently runs one process: torchrun is used instead.)

Under torchrun on a CPU, Accelerate starts its process group only with ``ACCELERATE_USE_CPU=1``:
without it it reports one process and ``DistributedType.NO``, each rank trains its own unsynchronised
model, and an A/B against it reads about 1.8x where the fair figure is about 1.05x. Every run here
(``--versus`` or not) checks that Accelerate runs as many processes as torchrun started, distributed,
and exits 2 naming the fix otherwise (:func:`check_distributed`).

``--versus PLAN`` (a plan name of benchmarks/steptime.py) trains the library's plan and Accelerate
in the same processes, in alternating blocks of ``--block`` steps (``--steps`` blocks each): what
other jobs on a shared machine do to the clock falls on both alike, which separate runs minutes
apart cannot promise. Both loops time the batch's fetch, as the library's trials do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def endless(loader):
    """As the library's trial workers: a new epoch when the loader ends."""
    while True:
        yield from loader


def accelerate_step(accelerator, model, optim, batches, criterion):
    def step():
        tokens, targets = next(batches)
        loss = criterion(model(tokens), targets)
        accelerator.backward(loss)
        optim.step()
        optim.zero_grad()
        return loss.item()

    return step


def plan_step(name: str, small: bool):
    """One training step of the library's plan ``name`` (benchmarks/steptime.py's plans), via train_step."""
    import _usergpt as g
    import torch
    from steptime import plans

    import composable_atorch as ca

    torch.manual_seed(0)
    model_fn, data = g.builders(small)
    model = model_fn()
    loader = torch.utils.data.DataLoader(data, batch_size=g.GLOBAL_BATCH, shuffle=False, drop_last=True)
    model, optim, loader = ca.compose(plans()[name])(model, g.optim_fn(model), loader)
    batches = endless(loader)

    def step():
        tokens, targets = next(batches)
        return ca.train_step(model, optim, tokens, targets, g.criterion)

    return step


class NotDistributed(SystemExit):
    """Accelerate did not run distributed under torchrun: a comparison with it would be wrong."""


def check_distributed(accelerator, world: int) -> None:
    """Refuse an Accelerate that does not run the ``world`` processes torchrun started, distributed
    (exit status 2, the fix named): its numbers would be a single unsynchronised process's."""
    state = str(accelerator.distributed_type)
    if world > 1 and (accelerator.num_processes != world or state.endswith(".NO") or state == "NO"):
        message = (
            f"_accelerate_run.py: Accelerate runs {accelerator.num_processes} process(es), {state}, under torchrun's "
            f"{world}: it would train unsynchronised and any comparison with it would be wrong. On a CPU set "
            "ACCELERATE_USE_CPU=1 in the environment (Accelerate starts its gloo process group only then)."
        )
        print(message, file=sys.stderr)
        raise NotDistributed(2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", action="store_true", help="the small variant of the model (_usergpt.SMALL)")
    parser.add_argument("--versus", default=None, help="a plan of benchmarks/steptime.py to alternate with")
    parser.add_argument("--block", type=int, default=5, help="steps per block with --versus")
    args = parser.parse_args()

    import _usergpt as g
    import torch
    from accelerate import Accelerator

    torch.set_num_threads(1)  # as the library's trial workers: one thread per rank
    accelerator = Accelerator() if args.mixed_precision == "no" else Accelerator(mixed_precision=args.mixed_precision)
    check_distributed(accelerator, int(os.environ.get("WORLD_SIZE", "1")))
    torch.manual_seed(0)
    model_fn, data = g.builders(args.small)
    model = model_fn()
    optim = g.optim_fn(model)
    per_rank = g.GLOBAL_BATCH // accelerator.num_processes
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank, shuffle=False, drop_last=True)
    model, optim, loader = accelerator.prepare(model, optim, loader)
    steps = {"accelerate": accelerate_step(accelerator, model, optim, endless(loader), g.criterion)}
    if args.versus:
        steps[args.versus] = plan_step(args.versus, args.small)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    rounds, block = (args.steps, args.block) if args.versus else (1, args.steps)
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in order:
            accelerator.wait_for_everyone()
            for _ in range(block):
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "step_times": times["accelerate"],
                    "versus": {k: v for k, v in times.items() if k != "accelerate"},
                    "processes": accelerator.num_processes,
                    "state": str(accelerator.distributed_type),
                    "load_average": os.getloadavg(),
                },
                f,
            )


if __name__ == "__main__":
    main()

"""Launched by tests/cli/test_elastic_launch.py and benchmarks/elastic.py: fsdp training across membership changes.

    train_elastic.py --ckpt DIR --out DIR --steps N --save-every K [--victim-pause S] [--grow-pause S:W] [--hybrid]

The user's script as the README shows it: apply the plan at whatever ``WORLD_SIZE`` this round
has, resume from the latest checkpoint, train, save every K steps. A tiny MLP on 48 numbered
samples, global batch 12 (a multiple of 3 and 4), AdamW. Each process appends one JSON line per
step to ``OUT/steps-{pid}.jsonl``: the step, epoch, rank, world, the sample ids it trained on, its
loss, the step the round resumed from, the wall time, the step's and the save's seconds, and on
its first step after a restart what ``report_resumed`` measured.

``--hybrid`` trains under hybrid sharding instead: ``parallel_mode([("zero", processes per node),
("data", nodes)])`` with ``fsdp()`` shards inside each node and replicates across nodes.

Test hooks: ``--victim-pause S`` makes each worker of the launcher started with
``ELASTIC_VICTIM=1`` write ``OUT/victim-{local rank}.pid`` after step S of the first round and wait to be
killed (its peers go on into the next step's collectives and block there, as with a machine lost
mid-step). ``--grow-pause S:W`` makes every rank of a world-W round write ``OUT/paused-{rank}``
after step S and wait (a node joining then restarts them). Waits end after 120 s. At the end
rank 0 writes the full model state to ``OUT/final.safetensors``.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, Dataset

import composable_atorch as ca
from composable_atorch import report_resumed
from composable_atorch.state.files import latest_checkpoint

SAMPLES, BATCH, FEATURES = 48, 12, 8


class Numbered(Dataset):
    """Fixed random regression samples that carry their index, so the test can count them."""

    def __init__(self, n: int = SAMPLES):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, 1, generator=g)).tanh() + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--victim-pause", type=int, default=None)
    parser.add_argument("--grow-pause", default=None)
    parser.add_argument("--hybrid", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    ca.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model()
    optim = make_optimizer(model)
    loader = DataLoader(Numbered(), batch_size=BATCH, shuffle=True)
    plan = ca.fsdp()
    if args.hybrid:
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        plan = ca.compose(ca.parallel_mode([("zero", per_node), ("data", world // per_node)]), ca.fsdp())
    model, optim, loader = plan(model, optim, loader)  # the plan, at this round's world size
    placements = str(next(model.parameters()).placements)

    step = 0
    if latest_checkpoint(args.ckpt) is not None:
        step = ca.load_state(args.ckpt, model, optim, loader).step
    start = step
    grow = None if args.grow_pause is None else tuple(int(v) for v in args.grow_pause.split(":"))
    log = open(os.path.join(args.out, f"steps-{os.getpid()}.jsonl"), "a")
    epoch = loader.epoch
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y, ids in loader:
            began = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
            step += 1
            step_s, save_s = time.perf_counter() - began, None
            resumed = report_resumed(step, args.ckpt)  # before saving: the latest checkpoint is the resumed one
            if step % args.save_every == 0:
                began = time.perf_counter()
                ca.save_state(args.ckpt, model, optim, loader, step=step)
                save_s = time.perf_counter() - began
            record = {
                "step": step,
                "epoch": epoch,
                "rank": rank,
                "world": world,
                "ids": ids.tolist(),
                "loss": loss.item(),
                "start": start,
                "time": time.time(),
                "step_s": step_s,
                "save_s": save_s,
                "placements": placements,
            }
            if resumed is not None:
                record["resumed"] = resumed
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step == args.victim_pause and start == 0 and os.environ.get("ELASTIC_VICTIM") == "1":
                with open(os.path.join(args.out, f"victim-{os.environ['LOCAL_RANK']}.pid"), "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(120)
            if grow == (step, world):
                open(os.path.join(args.out, f"paused-{rank}"), "w").close()
                time.sleep(120)
            if step >= args.steps:
                break
        epoch += 1
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(args.out, "final.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

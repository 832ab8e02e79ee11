"""Launched by tests/state/test_checkpointing.py: train a tiny GPT with fsdp, checkpointing and resuming.

    train_resumable.py --ckpt DIR --out DIR --steps N --save-every K [--pause-after S] [--full-state]
                       [--asynchronous] [--kill-after-save S:MS]

Resumes from the latest checkpoint in ``--ckpt`` if there is one. Each rank appends
``{"step", "loss"}`` lines to ``OUT/losses-rank{r}.jsonl`` (fsynced, so they survive a SIGKILL).
``--pause-after S`` makes each rank write ``OUT/pid-rank{r}`` after step S and wait to be
killed. ``--full-state`` makes rank 0 gather the full model and optimizer state at every save and
at the end into ``OUT/full-step-{step}.safetensors`` (the reference for resharding checks).
``--asynchronous`` saves with ``asynchronous=True``. ``--kill-after-save S:MS`` makes rank 1 SIGKILL
itself MS milliseconds after the save call of step S returned (an asynchronous save's writer is then
still writing, or done).
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state.save import latest_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--save-every", type=int, required=True)
parser.add_argument("--pause-after", type=int, default=None)
parser.add_argument("--full-state", action="store_true")
parser.add_argument("--asynchronous", action="store_true")
parser.add_argument("--kill-after-save", default=None)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2, dropout=0.1))
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = DataLoader(TextDataset(16, limit=48), batch_size=8, shuffle=True)
model, optim, loader = ca.fsdp(wrap=Block)(model, optim, loader)


def full_state(step: int) -> None:
    """All ranks take part; rank 0 writes the gathered state (test reference only)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, [optim.optimizer], options=options)
    if rank == 0:
        tensors = {f"model.{k}": v for k, v in model_sd.items()}
        tensors.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, f"full-step-{step}.safetensors")
        )


kill = None if args.kill_after_save is None else tuple(int(v) for v in args.kill_after_save.split(":"))
step = 0
if latest_checkpoint(args.ckpt) is not None:
    step, extra = ca.load_state(args.ckpt, model, optim, loader)
    assert extra == {"note": f"saved at {step}"}, extra
log = open(os.path.join(args.out, f"losses-rank{rank}.jsonl"), "a")
epoch = loader.epoch
while step < args.steps:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        loss = lm_loss(model(x), y)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        step += 1
        log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        log.flush()
        os.fsync(log.fileno())
        if step % args.save_every == 0:
            if args.full_state:  # before the save call: nothing delays a kill after it
                full_state(step)
            ca.save_state(
                args.ckpt,
                model,
                optim,
                loader,
                step=step,
                extra={"note": f"saved at {step}"},
                asynchronous=args.asynchronous,
            )
            if kill is not None and kill[0] == step and rank == 1:
                time.sleep(kill[1] / 1000)
                os.kill(os.getpid(), signal.SIGKILL)
        if step == args.pause_after:
            with open(os.path.join(args.out, f"pid-rank{rank}"), "w") as f:
                f.write(str(os.getpid()))
            while True:  # wait for the test to SIGKILL this process
                time.sleep(0.2)
        if step >= args.steps:
            break
    epoch += 1
ca.wait_for_saves()  # the write's collectives need the group
if args.full_state:
    full_state(step)
dist.destroy_process_group()

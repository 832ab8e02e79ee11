"""Compose fsdp | amp("bf16") | checkpoint on the built-in GPT, train it in a plain loop, save and resume.

Tiny, on this CPU (two gloo processes, well under a minute)::

    python -m composable_atorch launch --nproc 2 examples/compose_gpt.py --out runs/compose_gpt

Stop a run early (``--stop-at 4``, or kill it) and run the same command again: it resumes from
``runs/compose_gpt/ckpt`` (weights, optimizer, LR scheduler, data position, RNG), says how many
batches it skips, and finishes the schedule of ``--steps``.

Full size on GPUs (one node of 8; the launcher passes ``--nnodes/--node-rank/--rdzv-endpoint``
to torchrun for several)::

    python -m composable_atorch launch --nproc 8 examples/compose_gpt.py \\
        --d-model 1024 --n-layer 24 --n-head 16 --seq-len 1024 --batch-size 256 --steps 20000

The plan is the same on both; on CUDA the process group is NCCL and amp's bf16 runs on tensor cores.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from rich.progress import Progress
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state.hf import save_pretrained
from composable_atorch.state.save import latest_checkpoint
from composable_atorch.state.trackers import init_trackers

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="runs/compose_gpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--stop-at", type=int, default=None, help="stop (after saving) at this step; run again to resume")
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=8, help="the global batch")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--d-model", type=int, default=64)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
dist.init_process_group("nccl" if device == "cuda" else "gloo")
rank = dist.get_rank()
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head)).to(device)
optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
loader = DataLoader(
    TextDataset(args.seq_len, limit=args.batch_size * args.steps), batch_size=args.batch_size, shuffle=True
)

plan = ca.fsdp(wrap=(Block,)) | ca.amp("bf16") | ca.checkpoint(Block)
if rank == 0:
    print(plan.explain())
model, optim, loader = plan(model, optim, loader)
# the scheduler is built on the optimizer the plan returned
scheduler = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=args.lr, total_steps=args.steps)

stop = min(args.steps, args.stop_at or args.steps)
ckpt = os.path.join(args.out, "ckpt")
step = 0
if latest_checkpoint(ckpt) is not None:
    step, _ = ca.load_state(ckpt, model, optim, loader, scheduler=scheduler)  # prints what it skips

tracking = init_trackers("compose_gpt", log_with="jsonl", project_dir=args.out, config=vars(args), plan=plan)
with Progress(disable=rank != 0) as bar:
    task = bar.add_task("training", total=args.steps, completed=step)
    while step < stop:
        for x, y in loader:
            loss = lm_loss(model(x.to(device)), y.to(device))
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
            scheduler.step()
            step += 1
            tracking.log({"loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)
            bar.update(task, completed=step, description=f"loss {loss.item():.3f}")
            if step % args.save_every == 0 or step == stop:
                ca.save_state(ckpt, model, optim, loader, step=step, scheduler=scheduler, keep=2)
            if step == stop:
                break
tracking.finish()
save_pretrained(model, os.path.join(args.out, "final"))  # gathered once; model.safetensors
if rank == 0:
    print(f"trained to step {step}; checkpoint in {ckpt}, weights in {args.out}/final")
dist.destroy_process_group()

"""HF Accelerate's migration walk-through, with this library in place of HF Accelerate.

The walk-through starts from a plain DDP script (``ddp_train``) and marks every line it changes to use
Accelerate; here the same marks show the lines that change to use composable_atorch
(``composable_train``):

    step4.A import / B plan / C wrap objects / D backward      (the basic steps)
    step4.E no DistributedSampler / F no DDP wrap / G no .to(device) / H gather the metric / I report
    IV.A    mixed precision              -> amp("bf16") in the plan
    V.A     gradient accumulation        -> accumulate(steps) in the plan
    V.B     the accumulate context       -> nothing: optim.step() only steps at a window's end
    V.C     count optimizer steps        -> optim.is_boundary (Accelerate's sync_gradients)
    VI.A-D  logging                      -> init_trackers(log_with=...) / log / finish
    VII.A   save                         -> save_pretrained(model, dir) (gathered once; HF layout)
    VIII.A-C resume                      -> save_state / load_state (skips the batches already seen)

Tiny, on this CPU (both scripts one after the other, about half a minute)::

    python -m composable_atorch launch --nproc 2 examples/accelerate_to_composable.py --out runs/acc

Run it again with ``--resume`` to continue the composable run from its last checkpoint.

Full size on GPUs (8 per node; several nodes through the launcher's --nnodes/--rdzv-endpoint)::

    python -m composable_atorch launch --nproc 8 examples/accelerate_to_composable.py \\
        --d-model 768 --n-layer 12 --n-head 12 --seq-len 512 --batch-size 256 --steps 5000 --log-with tensorboard
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss


def get_dataloader(args, split: str = "train", distributed_sampler: bool = False) -> DataLoader:
    """step2: refactor into functions. Data: byte windows of text every Python ships."""
    data = TextDataset(args.seq_len, split=split, limit=args.batch_size * 32)  # fixed: a resumed run sees the same data
    if distributed_sampler:  # the DDP script's per-rank batch and sampler
        sampler = torch.utils.data.DistributedSampler(data, shuffle=split == "train", seed=0)
        return DataLoader(data, batch_size=args.batch_size // dist.get_world_size(), sampler=sampler)
    return DataLoader(data, batch_size=args.batch_size, shuffle=split == "train")  # the global batch


def get_model(args):
    """step2: the model and its optimizer."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


@torch.no_grad()
def accuracy(model, loader, device=None) -> float:
    """Next-byte accuracy over the validation split, summed over ranks (step4.H: gather)."""
    model.eval()
    counts = torch.zeros(2)
    for x, y in loader:
        if device is not None:  # step4.G: the composable version moves nothing by hand
            x, y = x.to(device), y.to(device)
        counts += torch.tensor([float((model(x).argmax(-1) == y).sum()), float(y.numel())])
    dist.all_reduce(counts)  # H. gather the counts of every rank, not just this one's
    model.train()
    return float(counts[0] / counts[1])


# -- step1: the plain DDP script ---------------------------------------------------------------------
def ddp_train(args) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cpu")
    model, optimizer = get_model(args)
    model = DDP(model.to(device))
    loader = get_dataloader(args, distributed_sampler=True)
    step = 0
    while step < args.steps:
        loader.sampler.set_epoch(step)
        for x, y in loader:
            loss = lm_loss(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    acc = accuracy(model, get_dataloader(args, "val", distributed_sampler=True), device)
    if dist.get_rank() == 0:
        print(f"[ddp] step {step} loss {loss.item():.3f} val accuracy {acc:.3f}")
        torch.save(model.module.state_dict(), os.path.join(args.out, "ddp_model.pt"))


# -- step4: the same script with composable_atorch -------------------------------------------------
def composable_train(args) -> None:
    from rich.progress import Progress

    import composable_atorch as ca  # step4.A import
    from composable_atorch.state.hf import save_pretrained
    from composable_atorch.state.save import latest_checkpoint
    from composable_atorch.state.trackers import init_trackers

    # step4.B the plan (Accelerator() in Accelerate's); IV.A mixed precision; V.A gradient accumulation
    plan = ca.ddp() | ca.amp("bf16") | ca.accumulate(args.accumulate) | ca.checkpoint(Block)
    model, optimizer = get_model(args)
    loader = get_dataloader(args)  # step4.E no DistributedSampler: the plan makes it (the global batch)
    model, optimizer, loader = plan(model, optimizer, loader)  # step4.C wrap; F: no DDP(...) by hand
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))

    # VI.A set logging + VI.B initiate tracker: hyper-parameters and the plan logged at start, rank 0 only
    tracking = init_trackers("acc", log_with=args.log_with, project_dir=args.out, config=vars(args), plan=plan)
    ckpt = os.path.join(args.out, "ckpt")
    step = 0  # optimizer steps
    if args.resume and latest_checkpoint(ckpt):  # VIII.B resume option
        step, _ = ca.load_state(
            ckpt, model, optimizer, loader, scheduler=scheduler
        )  # VIII.C resume; skips seen batches

    with Progress(disable=dist.get_rank() != 0) as bar:
        task = bar.add_task("composable", total=args.steps, completed=step)
        while step < args.steps:
            for x, y in loader:  # step4.G no .to(device)
                loss = lm_loss(model(x), y)
                optimizer.backward(loss)  # step4.D backward (scales, skips sync inside a window)
                syncs = optimizer.is_boundary  # V.C Accelerate's sync_gradients: does this micro-step step?
                optimizer.step()  # V.B steps only at the end of an accumulation window
                optimizer.zero_grad()  # keeps the sum inside a window
                if not syncs:
                    continue
                scheduler.step()
                step += 1
                tracking.log({"loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)  # VI.D log variables
                bar.update(task, completed=step)
                if step % args.save_every == 0:  # VIII.A save for resume
                    ca.save_state(ckpt, model, optimizer, loader, step=step, scheduler=scheduler, keep=2)
                if step == args.steps:
                    break
    acc = accuracy(model, get_dataloader(args, "val", distributed_sampler=True))
    tracking.log({"val_accuracy": acc}, step=step)
    tracking.finish()  # VI.C end tracking
    save_pretrained(model, os.path.join(args.out, "model"))  # VII.A save (Accelerate: unwrap_model(m).save_pretrained)
    if dist.get_rank() == 0:
        print(f"[composable] step {step} loss {loss.item():.3f} val accuracy {acc:.3f}")  # step4.I report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/accelerate_to_composable")
    parser.add_argument("--mode", choices=("ddp", "composable", "both"), default="both")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--log-with", default="jsonl", help="jsonl, tensorboard, wandb, mlflow, aim, comet_ml or all")
    parser.add_argument("--batch-size", type=int, default=8, help="the global batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()  # step3: a main function
    dist.init_process_group("gloo")
    os.makedirs(args.out, exist_ok=True)
    if args.mode in ("ddp", "both"):
        ddp_train(args)
    if args.mode in ("composable", "both"):
        composable_train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

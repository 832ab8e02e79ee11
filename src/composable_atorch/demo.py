"""The main job: train the built-in tiny GPT on the built-in corpus with a composed plan.

``python -m composable_atorch demo [--steps N] [--plan PLAN.json]`` prints the plan's explain(),
shows a progress bar, and reports the loss falling (first vs last 10-step mean).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch.utils.data import DataLoader

from . import strategy
from .compose import compose
from .data import TextDataset
from .models import GPT, Block, GPTConfig
from .models.gpt import lm_loss
from .transforms.loop import clip_grad
from .transforms.memory import checkpoint
from .transforms.precision import amp


def default_plan():
    return checkpoint(Block) | amp("bf16") | clip_grad(1.0)


def train(plan, *, steps: int, batch_size: int, seq_len: int, seed: int = 0, progress: bool = True) -> list[float]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=seq_len, d_model=128, n_layer=4, n_head=4))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = DataLoader(TextDataset(seq_len), batch_size=batch_size, shuffle=True, drop_last=True)
    model, optim, loader = plan(model, optim, loader)
    print(plan.explain())
    losses: list[float] = []
    columns = (TextColumn("[bold]training"), BarColumn(), TextColumn("step {task.completed}/{task.total}"), TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("train", total=steps, loss=float("nan"))
        data = iter(loader)
        while len(losses) < steps:
            try:
                x, y = next(data)
            except StopIteration:
                data = iter(loader)
                continue
            loss = lm_loss(model(x), y)
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=losses[-1])
    return losses


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m composable_atorch demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--plan", default=None, help="a saved plan JSON to train with instead of the default")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    plan = strategy.load(args.plan) if args.plan else compose(default_plan())
    start = time.perf_counter()
    losses = train(plan, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    first, last = sum(losses[:10]) / min(10, len(losses)), sum(losses[-10:]) / min(10, len(losses))
    print(f"loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f} ({time.perf_counter() - start:.0f} s)")
    return 0 if last < first else 1

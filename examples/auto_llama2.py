"""ATorch's fully automatic example: ``auto_accelerate`` with no load_strategy searches the plan.

An optuna study measures a few plans (each in fresh worker processes at this world size, with a
time limit: a crash or a hang is a failed trial, never a dead study), prints the trials table, and
the fastest plan that trained is applied here and trained for a few steps.

Tiny, on this CPU (3 trials of a 2-layer Llama from a config; about a minute)::

    python -m composable_atorch launch --nproc 2 examples/auto_llama2.py --out runs/auto_llama2

Full size on GPUs (ATorch's Llama2-7B on 8 GPUs; a longer budget and a memory limit per rank)::

    MODEL_NAME_OR_PATH=meta-llama/Llama-2-7b-hf python -m composable_atorch launch --nproc 8 \\
        examples/auto_llama2.py --trials 30 --time-limit 3600 --trial-timeout 600 \\
        --memory-limit 75GiB --seq-len 4096 --batch-size 32

The study persists in ``OUT/study.db`` (rerun to resume it) and the best plan in
``OUT/best_plan.json`` (reuse it as ``load_strategy``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from rich.progress import track

import composable_atorch as ca
from composable_atorch import auto_accelerate

from _llama_data import Windows, causal_lm_loss, llama_and_tokens


def main() -> None:
    """Everything runs under main(): the trials spawn processes that import this file (multiprocessing's rule)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/auto_llama2")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=90.0, help="seconds for the whole search")
    parser.add_argument("--trial-timeout", type=float, default=60.0, help="seconds for one trial")
    parser.add_argument("--memory-limit", default=None, help="peak bytes per rank, e.g. 300MiB")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the chosen plan")
    parser.add_argument("--batch-size", type=int, default=4, help="the global batch")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    model_path = os.environ.get("MODEL_NAME_OR_PATH")

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    # trials run in fresh processes that unpickle the dataset and loss: they must import _llama_data too
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)

    model, tokens = llama_and_tokens(model_path, args.seq_len)
    dataset = Windows(tokens, args.seq_len, args.batch_size * 16)

    status, result, best_strategy = auto_accelerate(
        model,
        torch.optim.AdamW,
        dataset,
        loss_func=causal_lm_loss,
        model_input_format="unpack_dict",
        optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": args.batch_size, "shuffle": True, "drop_last": True},
        # a small space for the tiny run (fp8 is emulated and compile cold-builds on a CPU); drop this at full size
        excluded=sorted(set(ca.registry()) - {"amp", "checkpoint", "ddp", "fsdp", "zero1", "zero2"}),
        save_strategy_to_file=os.path.join(args.out, "best_plan.json"),
        verbose=True,  # prints the trials table and the chosen plan
        n_trials=args.trials,
        time_limit=args.time_limit,
        trial_timeout=args.trial_timeout,
        memory_limit=args.memory_limit,
        storage=os.path.join(args.out, "study.db"),
    )
    if not status:
        raise SystemExit("auto_accelerate: no plan trained within the budget")
    model, optim, loader = result.model, result.optim, result.dataloader
    device = next(model.parameters()).device
    batches = iter(loader)
    for _ in track(range(args.steps), description="training the best plan", disable=rank != 0):
        batch = next(batches)
        loss = result.loss_func(batch, model(**result.prepare_input(batch, device)))
        optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        optim.step()
        optim.zero_grad()
    if rank == 0:
        print(f"best plan: {best_strategy.to_json()}\nlast loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""``python -m composable_atorch plan --model llama3-8b --gpu h100-sxm --world-size 64 --nodes 8 --seq 8192
--global-batch 512``: plan a training run for a cluster you do not have.

The search on paper (``search(workload, on_paper=True, env=...)``, :mod:`composable_atorch.auto.onpaper`):
the compose space at that world (engines, hybrid sharding over nodes, tensor x data, context and
Ulysses degrees, pipeline degrees, schedules and micro-batches, checkpoint none / selective / full,
micro-batches per rank, bf16 / fp8 where the GPU has fp8, compile), each plan priced by the estimate
on the ``--gpu`` (nothing runs, nothing real is allocated), those over the device's memory (with
``--margin``) dropped, the rest ranked by predicted tokens/s per device. Prints the table and what
became of the rest of the space, and writes the pick to ``--out`` (a plan JSON: ``strategy.load(path,
env=...)`` on the cluster, or ``python -m composable_atorch estimate`` it). ``--json`` prints the result
as JSON (keys: ``ranking`` rows with ``plan``, ``step_time_s``, ``tokens_per_s_per_device``,
``tflops_per_device``, ``mfu``, ``hfu``, ``peak_bytes``, ``fits``; ``dropped``; ``notes``; ``best_plan``).

``--model``: gpt (the built-in), llama-7b, llama3-8b (published shapes, no download) or
``hf:<path to a config.json>``. The workload: ``--global-batch`` sequences of ``--seq`` tokens per
optimizer step, next-token cross-entropy, AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from composable_atorch.errors import CompositionError, ConfigError


def parse(argv: list[str]) -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m composable_atorch plan", description=__doc__, formatter_class=raw)
    parser.add_argument("--model", required=True, help="gpt | llama-7b | llama3-8b | hf:<config.json>")
    parser.add_argument("--gpu", default="h100-sxm", help="catalog name (h100-sxm, a100-80gb-sxm, ...) or .json/.toml")
    parser.add_argument("--world-size", type=int, required=True, help="GPUs in the cluster")
    parser.add_argument("--nodes", type=int, default=None, help="machines (default: world / GPUs per node)")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sample")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step, all GPUs")
    parser.add_argument("--device-memory", default=None, help="bytes per GPU, e.g. 70GiB (default: the GPU's)")
    parser.add_argument("--margin", type=float, default=0.1, help="safety margin on predicted memory (fraction)")
    parser.add_argument("--time-limit", type=float, default=90.0, help="seconds of pricing (then no new estimate)")
    parser.add_argument("--max-plans", type=int, default=None, help="plans priced at most (default: no limit)")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranking printed")
    parser.add_argument("--out", default="best_plan.json", help="where the pick is written ('' : not written)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser.parse_args(argv)


def check(args: argparse.Namespace):
    """Every argument checked before any work: the environment, the workload and the budget, or a typed error."""
    from composable_atorch.auto.onpaper import token_workload
    from composable_atorch.auto.policy import Budget
    from composable_atorch.cli.estimate import build_model
    from composable_atorch.environment import Environment
    from composable_atorch.hardware import resolve

    for name in ("world_size", "seq", "global_batch", "top", "max_plans"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", value, "an integer >= 1")
    if args.nodes is not None and (args.nodes < 1 or args.world_size % args.nodes):
        raise ConfigError("--nodes", args.nodes, f"a divisor of --world-size {args.world_size} (equal nodes)")
    hw = resolve(args.gpu)  # HardwareError naming the nearest catalog names
    nodes = args.nodes if args.nodes is not None else max(1, -(-args.world_size // hw.devices_per_node))
    env = Environment(world_size=args.world_size, nodes=nodes, device="cuda", hardware=hw)
    if args.global_batch % args.world_size:
        lower = args.global_batch - args.global_batch % args.world_size
        raise ConfigError(
            "--global-batch",
            args.global_batch,
            f"a multiple of the world size {args.world_size} (each data-parallel rank takes an equal share), "
            f"e.g. {lower or args.world_size} or {lower + args.world_size}",
        )
    if args.model.startswith("hf:") and not Path(args.model[3:]).is_file():
        raise ConfigError("--model", args.model, "hf:<path to an existing config.json>")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise ConfigError("--out", args.out, "a file in an existing directory, or '' to write none")
    if not 0 <= args.margin < 1:
        raise ConfigError("--margin", args.margin, "a fraction >= 0 and < 1, e.g. 0.1")
    if args.time_limit <= 0:
        raise ConfigError("--time-limit", args.time_limit, "a positive number of seconds")
    budget = Budget(
        n_trials=args.max_plans, time_limit=args.time_limit, memory_limit=args.device_memory, memory_margin=args.margin
    )
    workload = token_workload(build_model(args.model, args.seq), seq=args.seq, global_batch=args.global_batch)
    return env, workload, budget


def main(argv: list[str]) -> int:
    from composable_atorch.auto import search

    args = parse(argv)
    try:
        env, workload, budget = check(args)
        if not args.json:
            print(
                f"planning {args.model} on {args.world_size} x {env.hardware.name} ({env.nodes} nodes), "
                f"{args.global_batch} x {args.seq} tokens per step; each plan priced on paper:",
                file=sys.stderr,
            )
        result = search(workload, on_paper=True, env=env, budget=budget, progress=not args.json)
    except CompositionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written = result.write_best(args.out) if args.out else None
    if args.json:
        out = {**result.to_dict(args.top), "model": args.model, "seq": args.seq, "best_plan": written}
        print(json.dumps(out, indent=2))
    else:
        from rich.console import Console

        result.print(Console(width=max(150, _columns())), top=args.top)
        print(f"best plan written to {written}" if written else "no plan fits: nothing written")
    return 0 if result.ranking else 1


def _columns() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 0

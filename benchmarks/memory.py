"""Per-rank training-state memory of ddp / zero1 / zero2 / fsdp, and activation memory with checkpointing.

    python benchmarks/memory.py [--worlds 2 4] [--d-model 128] [--n-layer 4]

State bytes are counted exactly, per rank, after one real training step on a gloo process group
of N spawned processes: the local bytes of every parameter (a DTensor's local shard), of every
gradient, and of every tensor in the optimizer state (a ZeRO-1 optimizer's local partition).
DDP's reducer buckets, which hold another copy of the gradients, are not counted.

Activation bytes are measured on the built-in GPT in one process, two ways (CPU_FACTS):
``saved``: bytes of the tensors autograd saves for backward (a saved_tensors_hooks counter, one
count per storage); ``profiler``: the net CPU memory the forward leaves allocated, summed over
``torch.profiler`` ops with ``profile_memory=True`` (it also sees what checkpointing keeps
outside autograd, such as the blocks' inputs).

Target: fsdp's state bytes per rank <= (1/N + 5%) of ddp's. Prints a table with PASS/FAIL per
target and writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

RESULTS = Path(__file__).parent / "results" / "memory.json"
PLANS = ("ddp", "zero1", "zero2", "fsdp")
TOLERANCE = 0.05


def make_plan(name: str):
    import composable_atorch as ca
    from composable_atorch.models import Block

    return {
        "ddp": lambda: ca.ddp(),
        "zero1": lambda: ca.ddp() | ca.zero1(),
        "zero2": lambda: ca.zero2(),
        "fsdp": lambda: ca.fsdp(wrap=Block),
        "none": lambda: ca.compose(),
    }[name]()


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds for ``t`` (a DTensor's local shard, not its global size)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optim) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer-state bytes of a (transformed) model and optimizer."""
    inner = getattr(optim, "optimizer", optim)
    inner = getattr(inner, "optim", inner)  # ZeRO-1: this rank's partition lives in the local optimizer
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer = sum(local_bytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def build(cfg: dict, batch: int):
    from composable_atorch.data import TextDataset
    from composable_atorch.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=cfg["seq_len"], d_model=cfg["d_model"], n_layer=cfg["n_layer"], n_head=4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TextDataset(cfg["seq_len"], limit=4 * batch), batch_size=batch)
    return model, optim, loader


def one_step_state(plan_name: str, cfg: dict, batch: int) -> dict[str, int]:
    """Apply the plan, train one step, and count the state (gradients kept: measured before zero_grad)."""
    from composable_atorch.models.gpt import lm_loss

    model, optim, loader = make_plan(plan_name)(*build(cfg, batch))
    x, y = next(iter(loader))
    optim.backward(lm_loss(model(x), y))
    optim.step()
    return state_bytes(model, optim)


def activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """Bytes the forward keeps for backward: autograd-saved tensors, and the profiler's net allocation."""
    from torch.profiler import ProfilerActivity, profile

    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    del out
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(tokens)
    net = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    del out
    return {"saved": sum(seen.values()), "profiler": int(net)}


# -- distributed part ---------------------------------------------------------------------------
def _rank(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {name: one_step_state(name, cfg, batch=2 * world) for name in PLANS}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure_world(world: int, cfg: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "init"), tmp, cfg), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    import composable_atorch as ca
    from composable_atorch.models import Block

    cfg = {"d_model": args.d_model, "n_layer": args.n_layer, "seq_len": args.seq_len}
    console = Console()
    report: dict = {"model": cfg, "state": {}, "activations": {}, "targets": []}
    started = time.perf_counter()
    for world in args.worlds:
        per_rank = measure_world(world, cfg)
        # per-rank bytes: the largest rank (shards can differ by padding)
        report["state"][world] = {name: {k: max(r[name][k] for r in per_rank) for k in per_rank[0][name]} for name in PLANS}

    table = Table(title=f"Per-rank training state, GPT d_model={args.d_model} n_layer={args.n_layer} (MiB)")
    for col in ("world", "plan", "params", "grads", "optimizer", "total", "vs ddp"):
        table.add_column(col, justify="right" if col not in ("plan",) else "left")
    mib = 1 / 2**20
    for world, plans in report["state"].items():
        ddp_total = plans["ddp"]["total"]
        for name, b in plans.items():
            ratio = b["total"] / ddp_total
            table.add_row(str(world), name, *(f"{b[k] * mib:.3f}" for k in ("params", "grads", "optimizer", "total")), f"{ratio:.3f}")
        limit = 1 / world + TOLERANCE
        ratio = plans["fsdp"]["total"] / ddp_total
        report["targets"].append({"target": f"fsdp <= (1/{world} + 5%) of ddp state bytes", "ratio": ratio, "limit": limit, "pass": ratio <= limit})
    console.print(table)
    console.print(
        "State at rest after a step. zero2 (FSDP2 with reshard_after_forward=False) keeps its parameters "
        "unsharded only between forward and backward, so at rest it equals fsdp."
    )

    # activations: one process, with and without checkpointing the blocks
    tokens = torch.randint(0, 256, (8, args.seq_len))
    act = Table(title=f"Activation bytes of one forward (batch 8, seq {args.seq_len}) (MiB)")
    for col in ("plan", "autograd-saved", "profiler net"):
        act.add_column(col, justify="left" if col == "plan" else "right")
    for name, plan in (("none", ca.compose()), ("checkpoint(Block)", ca.checkpoint(Block))):
        model, _, _ = plan(*build(cfg, 8)[:1], None, None)
        report["activations"][name] = activation_bytes(model, tokens)
        act.add_row(name, *(f"{report['activations'][name][k] * mib:.2f}" for k in ("saved", "profiler")))
    console.print(act)
    cut = report["activations"]["none"]["profiler"] / max(1, report["activations"]["checkpoint(Block)"]["profiler"])
    report["activation_reduction_profiler"] = cut

    for t in report["targets"]:
        verdict = "[green]PASS[/green]" if t["pass"] else "[red]FAIL[/red]"
        console.print(f"{verdict}  {t['target']}: fsdp/ddp = {t['ratio']:.3f} (limit {t['limit']:.3f})")
    console.print(f"checkpointing cuts activation memory {cut:.1f}x (profiler); took {time.perf_counter() - started:.0f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report["state"] = {str(k): v for k, v in report["state"].items()}
    RESULTS.write_text(json.dumps(report, indent=2))
    console.print(f"saved {RESULTS}")
    return 0 if all(t["pass"] for t in report["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())

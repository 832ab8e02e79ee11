"""Per-rank training-state memory of the MoE families with and without expert parallelism.

    python benchmarks/expert.py [--worlds 2 4]

The models are the tests' tiny MoE families (tests/zoo/moe.py: transformers 5's Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS from their configs, 4 experts, top-2). Bytes are counted
exactly, per rank, after one real AdamW step on a gloo process group: the local bytes of every
parameter (a DTensor's local shard), of every gradient and of every optimizer-state tensor, with
the experts' share apart. DDP's reducer buckets are not counted.

Layouts: at world 2, ``data 2`` (ddp, every rank holds every expert) against ``expert 2``; at world
4, ``data 4`` and ``fsdp over data 4`` against ``expert 2 x data 2``, ``expert 4`` and ``expert 2 x
fsdp 2`` (ATorch's expert_fsdp: experts sharded over the data group of 2, the rest over all 4).

Target: each rank's expert bytes (params, grads, AdamW state) are the one-process expert bytes
divided by the expert degree (and by the data degree under fsdp), exactly. Prints a table with
PASS/FAIL and writes benchmarks/results/expert.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "src")]

RESULTS = HERE / "results" / "expert.json"
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
#: world -> [(label, parallel_mode groups, fsdp?, expert parallel?)]
LAYOUTS = {
    2: [("data 2 (ddp)", [("data", 2)], False, False), ("expert 2 (ddp)", [("expert", 2), ("data", 1)], False, True)],
    4: [
        ("data 4 (ddp)", [("data", 4)], False, False),
        ("fsdp 4", [("data", 4)], True, False),
        ("expert 2 x data 2 (ddp)", [("expert", 2), ("data", 2)], False, True),
        ("expert 4 (ddp)", [("expert", 4), ("data", 1)], False, True),
        ("expert 2 x fsdp 2", [("expert", 2), ("data", 2)], True, True),
    ],
}


def _local(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _bytes(model, optim) -> dict:
    inner = getattr(optim, "optimizer", optim)
    by_param = {id(p): n for n, p in model.named_parameters()}
    out = {"params": 0, "grads": 0, "adam": 0, "expert_params": 0, "expert_grads": 0, "expert_adam": 0}
    for n, p in model.named_parameters():
        e = ".experts." in n
        out["params"] += _local(p)
        out["expert_params"] += _local(p) if e else 0
        if p.grad is not None:
            out["grads"] += _local(p.grad)
            out["expert_grads"] += _local(p.grad) if e else 0
    for p, st in inner.state.items():
        e = ".experts." in by_param.get(id(p), "")
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out["adam"] += _local(v)
                out["expert_adam"] += _local(v) if e else 0
    return out


def _run(name, groups, sharded, expert, rank):
    import composable_atorch as ca
    from zoo import moe as mm

    model = mm.build(name)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = [ca.parallel_mode(groups)]
    steps += [ca.expert_parallel()] if expert else []
    steps += [ca.fsdp()] if sharded else [ca.ddp()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optim, _ = ca.compose(*steps)(model, optim)
        world = torch.distributed.get_world_size()
        ids = mm.batch(0, size=world)[rank : rank + 1]
        optim.backward(mm.loss(name, model, ids))
        optim.step()
    return _bytes(model, optim)


def _world(rank, world):
    return {(n, label): _run(n, g, s, e, rank) for n in FAMILIES for label, g, s, e in LAYOUTS[world]}


def _one_process(name) -> dict:
    from zoo import moe as mm

    model = mm.build(name)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mm.loss(name, model, mm.batch(0, size=1)).backward()
    optim.step()
    return _bytes(model, optim)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from _dist import run_world

    rows, ok = [], True
    full = {n: _one_process(n) for n in FAMILIES}
    for world in args.worlds:
        per_rank = run_world(_world, world, timeout=1200)
        for n in FAMILIES:
            for label, groups, sharded, expert in LAYOUTS[world]:
                sizes = dict(groups)
                degree = sizes.get("expert", 1) if expert else 1
                data = world // degree
                split = degree * (data if sharded else 1)
                r0 = per_rank[0][(n, label)]
                want = {k: full[n][k] // split for k in ("expert_params", "expert_grads", "expert_adam")}
                exact = all(r[(n, label)][k] == want[k] for r in per_rank for k in want)
                ok &= exact
                total = r0["params"] + r0["grads"] + r0["adam"]
                experts = r0["expert_params"] + r0["expert_grads"] + r0["expert_adam"]
                rows.append(
                    {
                        "world": world,
                        "family": n,
                        "layout": label,
                        "state_bytes_rank0": total,
                        "expert_bytes_rank0": experts,
                        "one_process_state_bytes": full[n]["params"] + full[n]["grads"] + full[n]["adam"],
                        "one_process_expert_bytes": sum(full[n][k] for k in want),
                        "expert_split": split,
                        "exact": exact,
                        "per_rank": [r[(n, label)] for r in per_rank],
                    }
                )
    head = f"{'world':>5} {'family':<12} {'layout':<26} {'state KiB/rank':>14} {'experts KiB':>12}"
    print(f"{head} {'of 1 proc':>10}  target")
    for r in rows:
        print(
            f"{r['world']:>5} {r['family']:<12} {r['layout']:<26} {r['state_bytes_rank0'] / 1024:>14.1f} "
            f"{r['expert_bytes_rank0'] / 1024:>12.1f} {r['one_process_expert_bytes'] / 1024:>10.1f}  "
            f"{'PASS' if r['exact'] else 'FAIL'} (experts / {r['expert_split']})"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "all_exact": ok}, indent=1))
    print(f"{'PASS' if ok else 'FAIL'}: expert bytes per rank = one process's / (expert degree x fsdp data degree)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

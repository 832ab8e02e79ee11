"""Launched as two "nodes" of two processes on localhost by tests/parallel/test_hybrid_sharding.py.

    hybrid_nodes.py OUT_DIR

Each rank trains the test's user model under ATorch's ``sharding_strategy=HYBRID_SHARD`` with no
zero dimension (groups from the world: torchrun's LOCAL_WORLD_SIZE makes Environment.detect see 2
nodes) and under ``parallel_mode([("zero", 2), ("data", 2)])``, and writes its full parameters,
its local shard sizes and explain() as JSON (numbers as lists) for the test to compare.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import ShardingStrategy

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "parallel")]

import test_hybrid_sharding as T  # noqa: E402

import composable_atorch as ca  # noqa: E402
from composable_atorch.environment import Environment  # noqa: E402
from composable_atorch.transforms.parallel.data import Fsdp  # noqa: E402

ca.init_distributed("gloo")
torch.set_num_threads(1)
rank = torch.distributed.get_rank()
env = Environment.detect()
report = {"nodes": env.nodes, "per_node": env.processes_per_node}
spec = Fsdp.from_seed({"atorch_wrap_cls": (T.UserBlock,), "sharding_strategy": ShardingStrategy.HYBRID_SHARD})
for key, transforms in {
    "hybrid_shard": (ca.parallel_mode(), spec),
    "zero_dim": (ca.parallel_mode(T.HYBRID), ca.fsdp(wrap=(T.UserBlock,))),
}.items():
    r = T.run("user", "adamw", *transforms)
    report[key] = {
        "params": {k: v.tolist() for k, v in r["params"].items()},
        "local_numel": r["local_numel"],
        "placements": r["placements"],
        "explain": r["explain"],
    }
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
torch.distributed.destroy_process_group()

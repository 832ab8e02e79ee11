"""Launched by tests/cli/test_launch.py: each rank joins the group, all-reduces, and reports as JSON.

    report_ranks.py OUT_DIR [--exit-code N] [anything else, echoed back]

The last rank exits with ``--exit-code`` (default 0), to test that failures come back.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--exit-code", type=int, default=0)
args, rest = parser.parse_known_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
report = {
    "rank": rank,
    "world": world,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    "sum": total.item(),
    "args": rest,
}
with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
raise SystemExit(args.exit_code if rank == world - 1 else 0)

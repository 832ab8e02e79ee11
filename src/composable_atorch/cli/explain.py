"""``python -m composable_atorch explain PLAN.json [--world-size N] [--device cuda --cc 9.0]``."""

from __future__ import annotations

import argparse

from composable_atorch.core import strategy
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m composable_atorch explain", description=__doc__)
    parser.add_argument("plan", help="a plan JSON file written by strategy.dump / the search")
    parser.add_argument(
        "--world-size", type=int, default=None, help="check against this world size instead of this process's"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--cc", default=None, help="compute capability, e.g. 9.0 (with --device cuda)")
    args = parser.parse_args(argv)
    env = Environment.detect()
    changes = {}
    if args.world_size is not None:
        changes["world_size"] = args.world_size
    if args.device is not None:
        changes["device"] = args.device
    if args.cc is not None:
        major, _, minor = args.cc.partition(".")
        changes["compute_capability"] = (int(major), int(minor or 0))
    try:
        plan = strategy.load(args.plan, env=env.with_(**changes))
    except CompositionError as exc:
        print(f"error: {exc}")
        return 2
    print(plan.explain())
    return 0

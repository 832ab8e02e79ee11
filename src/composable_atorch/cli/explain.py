"""``python -m composable_atorch explain PLAN.json [--world-size N] [--device cuda --cc 9.0] [--trust MODULE]``.

A plan file is data: explaining it imports nothing it names. ``python -m`` puts the current
directory first on ``sys.path``, where a file named like a module the CLI imports later would
shadow it, so that entry is removed before anything else is read. A plan naming classes of a
module this process has not imported (the user's model module, transformers) is refused with the
fix: ``--trust MODULE`` imports a module the *user* names on the command line, never one the plan names.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _drop_cwd_from_path() -> None:
    here = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) != here]


def main(argv: list[str]) -> int:
    _drop_cwd_from_path()
    from composable_atorch.core import strategy
    from composable_atorch.environment import Environment
    from composable_atorch.errors import CompositionError, UntrustedInputError

    parser = argparse.ArgumentParser(prog="python -m composable_atorch explain", description=__doc__)
    parser.add_argument("plan", help="a plan JSON file written by strategy.dump / the search")
    parser.add_argument(
        "--world-size", type=int, default=None, help="check against this world size instead of this process's"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--cc", default=None, help="compute capability, e.g. 9.0 (with --device cuda)")
    parser.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this installed module first, so the plan may name its classes (repeatable)",
    )
    args = parser.parse_args(argv)
    importlib.import_module("composable_atorch.models")  # the built-in models plans from `demo` name
    for name in args.trust:
        importlib.import_module(name)
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
    except UntrustedInputError as exc:
        print(f"error: {exc}\n(to let the plan name a module's classes: --trust MODULE)")
        return 2
    except CompositionError as exc:
        print(f"error: {exc}")
        return 2
    print(plan.explain())
    return 0

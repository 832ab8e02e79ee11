"""``python -m composable_atorch <command>``: demo | search | estimate | plan | explain | launch.

Each command lives in its own module with a ``main(argv) -> int``; this file only dispatches, so
the CLI grows without a central if-chain.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("composable_atorch.cli.demo", "train the built-in GPT on the built-in corpus with a plan"),
    "search": ("composable_atorch.cli.search", "auto-search the fastest plan that fits memory"),
    "estimate": ("composable_atorch.cli.estimate", "predict per-rank memory of a plan (nothing real allocated)"),
    "plan": ("composable_atorch.cli.plan", "plan for a cluster you don't have: rank plans by predicted tokens/s"),
    "explain": ("composable_atorch.cli.explain", "print explain() of a saved plan JSON"),
    "launch": ("composable_atorch.cli.launch", "run a script on N processes or MIN:MAX elastic nodes (torchrun)"),
}


def usage() -> str:
    lines = ["usage: python -m composable_atorch <command> [args]", "", "commands:"]
    lines += [f"  {name:<8} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from composable_atorch.environment import quiet_imports

    with quiet_imports():  # optional packages' import-time lines the user did not ask for
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(rest) or 0)

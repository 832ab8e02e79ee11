"""``python -m composable_atorch search``: auto-search a plan and write the best one and a report.

    python -m composable_atorch search --world-size 2 --trials 8 --memory-limit 40MiB --out runs/search
    python -m composable_atorch search --task mypkg.train:workload --storage runs/s.db --study-name mine

Without ``--task`` the workload is the built-in tiny GPT on the built-in corpus. ``--task`` names a
function ``module:name`` that returns a :class:`~composable_atorch.auto.Workload`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from composable_atorch.auto import report
from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.study import search
from composable_atorch.auto.workload import GPTTask, Workload
from composable_atorch.errors import CompositionError, ConfigError


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def load_task(path: str) -> Workload:
    module, _, name = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError("--task", path, f"'module:function' returning a Workload ({exc})") from None
    workload = factory()
    if not isinstance(workload, Workload):
        raise ConfigError(
            "--task",
            path,
            f"a function returning a composable_atorch.auto.Workload (it returned {type(workload).__name__})",
        )
    return workload


def parser(prog: str = "python -m composable_atorch search") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--trials", type=int, default=None, help="plans to measure (default: every valid plan)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole search")
    p.add_argument(
        "--memory-limit", default=None, help="peak bytes per rank, e.g. 40MiB; over-budget plans are infeasible"
    )
    p.add_argument(
        "--memory-margin",
        type=float,
        default=0.03,
        help="safety margin on predicted memory: plans predicted over limit / (1 + margin) are not run",
    )
    p.add_argument("--no-predict", action="store_true", help="measure every proposed plan; no predictions first")
    p.add_argument("--exclude", default=None, help="comma-separated transform names to leave out")
    p.add_argument("--include", default=None, help="comma-separated transform names every plan must have")
    p.add_argument(
        "--compile", action="store_true", help="let torch.compile join the search (cold compiles take minutes)"
    )
    p.add_argument("--storage", default=None, help="sqlite file (or optuna URL) to persist and resume the study")
    p.add_argument("--study-name", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", default="tpe", choices=("tpe", "gp", "random"))
    p.add_argument(
        "--trial-timeout", type=float, default=120.0, help="seconds one trial may take before it counts as a hang"
    )
    p.add_argument("--out", default="runs/search", help="where best_plan.json, trials.json and report.html go")
    p.add_argument("--task", default=None, help="module:function returning a Workload (default: the built-in GPT)")
    g = p.add_argument_group("built-in GPT")
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--d-model", type=int, default=64)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--batch-size", type=int, default=16)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    console = report.console()
    try:
        if args.task:
            workload = load_task(args.task)
        else:
            workload = GPTTask(
                seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, batch_size=args.batch_size
            ).workload(args.seed)
        result = search(
            workload,
            trial=TrialSettings(world_size=args.world_size, measure_steps=5, timeout=args.trial_timeout),
            budget=Budget(
                n_trials=args.trials,
                time_limit=args.time_limit,
                memory_limit=args.memory_limit,
                memory_margin=args.memory_margin,
            ),
            space=SpaceOptions(
                excluded=_names(args.exclude), included=_names(args.include), allow_compile=args.compile
            ),
            study=StudyOptions(
                storage=args.storage,
                study_name=args.study_name,
                seed=args.seed,
                sampler=args.sampler,
                predict=not args.no_predict,
            ),
        )
    except CompositionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.show(console, result)
    written = report.write_all(result, args.out)
    for what, path in written.items():
        console.print(f"{what}: {path}")
    if result.best_plan is None:
        console.print("[red]no plan ran within the memory budget[/red]")
        return 1
    console.print(f"best: {result.best.plan_label} — {result.best.result.samples_per_s:.1f} samples/s")
    return 0

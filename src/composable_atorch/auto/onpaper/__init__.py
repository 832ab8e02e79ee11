"""The search on paper: the compose space at a cluster's world priced by the estimate, no trial run.

    env = Environment(world_size=64, nodes=8, device="cuda", hardware="h100-sxm")
    result = search(workload, on_paper=True, env=env)      # or plan_on_paper(workload, env)
    result.print(); result.write_best("best_plan.json")

:mod:`.axes` builds the space from each transform's ``candidates()`` at the target environment,
:mod:`.walk` moves through it one axis at a time (the rules that spare estimates are its docstring's),
:mod:`.price` prices one plan (:func:`composable_atorch.estimate.estimate`), :mod:`.result` ranks and
prints, :mod:`.tokens` is a workload of token shapes for a model named by its config.
"""

from __future__ import annotations

import time

from composable_atorch.auto.onpaper.axes import ABSENT, Space, build, with_packages
from composable_atorch.auto.onpaper.price import Priced, Pricer
from composable_atorch.auto.onpaper.result import PaperResult
from composable_atorch.auto.onpaper.tokens import TokenShapes, token_workload
from composable_atorch.auto.onpaper.walk import Walk
from composable_atorch.auto.policy import Budget, SpaceOptions
from composable_atorch.auto.workload import Workload
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError

__all__ = ["PaperResult", "Priced", "TokenShapes", "plan_on_paper", "printer", "reference", "token_workload"]

#: seconds of pricing when the budget gives no time limit: the whole command (imports, the model's
#: facts, the walk, the table) then ends within about two minutes on a 2-core machine
DEFAULT_SECONDS = 90.0
#: the margin on predicted memory when no budget is given: the simulation leaves out the CUDA context,
#: NCCL's and cuBLAS's workspaces and the caching allocator's rounding (about a few GiB on an 80 GB card)
DEFAULT_MARGIN = 0.1


def plan_on_paper(
    workload: Workload,
    env: Environment,
    *,
    budget: Budget | None = None,
    space: SpaceOptions | None = None,
    progress=None,
    estimator=None,
) -> PaperResult:
    """Rank the plans of ``workload`` at ``env`` (a cluster's world, nodes, device and hardware) by their
    predicted tokens/s per device, among those whose predicted peak fits the device's memory.

    ``budget``: ``memory_limit`` (default the hardware's memory), ``memory_margin`` (default
    :data:`DEFAULT_MARGIN` without a budget), ``time_limit`` (seconds of pricing, default
    :data:`DEFAULT_SECONDS`), ``n_trials`` (plans priced at most). ``space``: ``excluded`` /
    ``included`` kinds. ``progress(priced)`` is called after each estimate; ``estimator`` replaces
    :func:`composable_atorch.estimate.estimate` (tests)."""
    start = time.monotonic()
    env, notes = target(env)
    space = space or SpaceOptions()
    margin = budget.memory_margin if budget is not None else DEFAULT_MARGIN
    limit = (budget.memory_bytes if budget is not None else None) or int(env.hardware.memory_bytes)
    seconds = budget.time_limit if budget is not None and budget.time_limit is not None else DEFAULT_SECONDS
    built = build(workload, env, space)
    notes += built.notes
    pricer = Pricer(workload, env, limit, margin, start + seconds, estimator, whole_cost(built.example))
    walk = Walk(built, pricer, budget.n_trials if budget is not None else None, progress)
    walk.run(reference(built))
    priced = list(walk.priced.values())
    ranking = sorted((p for p in priced if p.fits), key=lambda p: -p.speed)
    return PaperResult(
        env,
        limit,
        margin,
        ranking,
        priced,
        walk.counts(),
        built.size,
        time.monotonic() - start,
        notes,
        built.describe(),
        dict(walk.failures),
        {"global_batch": workload.batch_size},
    )


def printer(stream=None):
    """``progress(priced)`` that prints one line per estimate (to stderr: the table goes to stdout)."""
    import sys

    from composable_atorch.auto.onpaper.axes import label_plan

    out = stream or sys.stderr
    count = [0]

    def show(p: Priced) -> None:
        count[0] += 1
        figure = f"{p.tokens_per_s_per_device:,.0f} tokens/s, {p.peak_bytes / 2**30:.1f} GiB" if p.peak_bytes else ""
        print(f"  [{count[0]:>3}] {p.status:<15} {figure:<28} {label_plan(p.plan)}  ({p.seconds:.1f} s)", file=out,
              flush=True)

    return show


def target(env: Environment | None) -> tuple[Environment, list[str]]:
    """The environment priced on: a GPU with a hardware (a ConfigError naming the fix otherwise, before any
    work), this machine's optional packages where it declares none."""
    if env is None or env.device != "cuda":
        raise ConfigError(
            "search(on_paper=True) env",
            None if env is None else env.describe(),
            "the cluster planned for, e.g. Environment(world_size=64, nodes=8, device='cuda', hardware='h100-sxm')",
        )
    notes = []
    if env.hardware is None:
        from composable_atorch.estimate.paper.setup import target_hardware

        env = env.with_(hardware=target_hardware(None))
        notes.append(f"no hardware given: priced on {env.hardware.name}")
    env, assumed = with_packages(env)
    return env, notes + ([assumed] if assumed else [])


def whole_cost(model) -> float:
    """How much longer the estimate takes on the whole model than on the few blocks it extrapolates from."""
    from composable_atorch.estimate import dedup

    found = dedup.find_blocks(model)
    if found is None or found[1] < dedup.AUTO_FROM:
        return 1.0
    return found[1] / sum(dedup.DEPTHS)


def reference(space: Space) -> dict[str, str]:
    """Where the walk starts: seed 002's plan where the axes offer it — fsdp over the blocks, bf16, every
    block checkpointed, compiled — "absent" on every other axis."""
    wanted = {
        "engine": lambda o: [t.name for t in o.transforms] == ["fsdp"] and not o.transforms[0].hybrid,
        "precision": lambda o: [t.name for t in o.transforms] == ["amp"] and o.transforms[0].dtype == "bf16",
        "checkpoint": lambda o: len(o.transforms) == 1 and o.transforms[0].policy == "full",
        "compile": lambda o: bool(o.transforms),
    }
    out = {}
    for name, axis in space.axes.items():
        label = axis.find(wanted[name]) if name in wanted else None
        out[name] = label or (ABSENT if ABSENT in axis.options else next(iter(axis.options)))
    return out

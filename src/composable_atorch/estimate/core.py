"""estimate(plan, model, batch, *, world_size, ...): per-rank memory of a plan before anything runs.

The plan is composed again for the world asked for (so a world size it cannot use is refused
before any work), each distinct rank is simulated once (:mod:`.simulate`), and the MemTracker
categories become a :class:`~.result.RankCost`. Ranks of a plan without a pipeline hold the same
shapes (shards are equal up to padding), so rank 0 stands for all of them. Under a pipeline the
ranks differ by stage: one rank per stage is simulated, in stage order (the first rank holding it;
:mod:`.pipeline`), and every rank gets its stage's cost. For tensor x pipeline x data layouts one
rank per stage is enough too: the tensor ranks of a stage hold equal shards of it (up to padding)
and the data ranks equal copies.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from composable_atorch.core import untrusted
from composable_atorch.core.compose import compose
from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import Transform
from composable_atorch.environment import Environment
from composable_atorch.errors import CompositionError, ConfigError
from composable_atorch.estimate import dedup as dd
from composable_atorch.estimate import paper
from composable_atorch.estimate.inputs import EstimateError, check_batch, check_world_size, meta_model
from composable_atorch.estimate.paper.price import layout_degrees
from composable_atorch.estimate.paper.setup import check_nodes, paper_step, target_hardware
from composable_atorch.estimate.result import Estimate, RankCost
from composable_atorch.estimate.simulate import simulate_rank

DEVICES = ("cuda", "cpu")

#: MemTracker category -> RankCost field (buffers travel with the parameters)
_KINDS = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporary",
    "Other": "temporary",
}


def as_plan_dict(plan: Any) -> dict:
    """A Plan, a transform (``fsdp() | amp()`` is already a Plan), a plan's dict, JSON text or a JSON file path."""
    if isinstance(plan, Plan):
        return plan.to_dict()
    if isinstance(plan, Transform):
        return compose(plan).to_dict()
    if isinstance(plan, dict):
        return plan
    if isinstance(plan, str | os.PathLike):
        text = str(plan)
        if not text.lstrip().startswith("{") and os.path.exists(text):
            text = untrusted.read_regular_file(text, "plan file").decode("utf-8", errors="replace")
        try:
            return untrusted.loads(text, "plan JSON")
        except json.JSONDecodeError as exc:
            raise ConfigError(
                "plan", str(plan)[:60], f"a Plan, a transform, or plan JSON (text or a file path): {exc.msg}"
            ) from None
    raise ConfigError("plan", type(plan).__name__, "a Plan, a transform, or plan JSON (text or a file path)")


def compose_for(data: dict, env: Environment, allow=()) -> Plan:
    """The plan composed for ``env``; a world size it cannot use is a ConfigError naming the fix.
    ``allow``: the objects of a plan given as an object (its own names, see core.codec)."""
    try:
        return Plan.from_dict(data, env=env, allow=allow)
    except CompositionError as exc:
        raise ConfigError(
            "world_size",
            env.world_size,
            f"a world size this plan can use ({type(exc).__name__}: {exc}); change world_size or the plan's degrees",
        ) from exc


def estimate(
    plan: Any,
    model: Any,
    batch: Any,
    *,
    world_size: int,
    device: str = "cuda",
    loss_fn=None,
    optimizer=None,
    step_time: bool = True,
    steps: int = 1,
    criterion=None,
    calibration=None,
    dedup: bool | None = None,
    hardware=None,
    nodes: int | None = None,
) -> Estimate:
    """Predict each rank's memory (and, where torch can, the step time) of ``plan`` on ``world_size`` ranks.

    ``model``: a module (on the meta device, built under ``record_module_init``, or anywhere: only
    shapes are read and it is not changed) or a function building one (called on meta).
    ``batch``: one batch as the loader yields it — the *global* batch, as everywhere in this
    library — as tensors (meta is fine) or shapes (``torch.Size`` stands for int64 token ids).
    ``loss_fn(model, batch) -> loss`` (default: HF ``.loss`` for dict batches, next-token
    cross-entropy for ``(inputs, targets)``); ``optimizer``: None (AdamW), a class or
    ``f(model) -> optimizer``. ``steps``: training steps measured after two warm-up steps (the
    peak is their maximum); 2 also counts what one step keeps alive into the next, e.g. a loop
    written ``outputs = model(**batch)`` holds the last outputs until the next forward returns
    (give such a ``loss_fn``). ``criterion(output, targets) -> loss`` with ``(inputs, targets)``
    batches, as the search's ``Workload.criterion``: a pipeline plan needs it (its loss runs inside
    the schedule on the last stage's output; without it a ConfigError names the fix), and without a
    ``loss_fn`` other plans train on it too (``criterion(model(inputs), targets)``, as
    :func:`composable_atorch.train_step`). ``device`` is the target the plan is checked against; the
    simulation itself runs on fake CPU tensors (see :mod:`.simulate`).

    Step time: on CUDA the simulated step's ordered ops priced on paper for ``hardware`` (a catalog
    name such as ``"h100-sxm"``, a declaration file or a :class:`~composable_atorch.hardware.Hardware`;
    default the GPU here if the catalog knows it, else ``"h100-sxm"``) over ``nodes`` machines
    (default: the world over the hardware's devices per node), with a GPU's overlap (:mod:`.paper`);
    the result gains tokens/s, TFLOP/s, MFU and HFU per device. ``step_time="runtime-estimator"``
    asks torch's RuntimeEstimator instead (it needs a real GPU). On the CPU the simulated step's ops
    are priced with this machine's calibration (:mod:`.steptime`; ``calibration``: a
    :class:`~.calibrate.Calibration`, default the cached one, measured once per machine).

    ``dedup``: extrapolate from a few repeated blocks or micro-steps (:mod:`.dedup`: the same estimate in
    a fraction of the time); None does so from ``dedup.AUTO_FROM`` blocks on, False never.
    """
    world_size = check_arguments(world_size, steps, device, criterion, step_time)
    global_batch = check_batch(batch)
    model = meta_model(model)
    notes: list[str] = []
    target = resolve_target(plan, world_size, device, step_time, hardware, nodes, calibration, notes)
    runtime_estimator = step_time == RUNTIME_ESTIMATOR and device == "cuda"
    sim_kw = dict(loss_fn=loss_fn, optimizer=optimizer, steps=steps, criterion=criterion, step_time=runtime_estimator)
    runs = simulate_runs(target, model, (batch, global_batch), sim_kw, dedup, notes)
    run = runs[0]
    notes += compile_notes(run, target.modelled, target.on_paper)
    ranks, extra = memory_report(runs, target, world_size, notes)
    timing, usage = step_timing(runs, target, model, (batch, global_batch), notes, extra)
    if not target.on_paper and timing is None and run.step_time_s is None:
        extra["step_time_reason"] = no_step_time_reason(step_time, device)
    notes, hw = list(dict.fromkeys(notes)), target.hardware  # a note each simulated window repeats, once
    return Estimate(
        ranks=ranks,
        world_size=world_size,
        device=device,
        steps=tuple(target.sim_plan.names),
        notes=tuple(notes),
        step_time_s=timing.seconds if timing is not None else max_or_none(r.step_time_s for r in runs),
        step_time_mode=(PAPER if target.on_paper else MODELLED) if timing is not None else run.step_time_mode,
        step_time=timing,
        flops=max_or_none(r.flops for r in runs),
        micro_batch=run.micro_batch,
        micro_batches=run.micro_batches,
        extra=extra,
        hardware=None if hw is None else hw.name,
        nodes=target.nodes,
        device_memory=None if hw is None else int(hw.memory_bytes),
        utilization=usage,
    )


def check_arguments(world_size, steps, device, criterion, step_time) -> int:
    """The world size, once every plain argument of :func:`estimate` is checked: a typed error
    naming the fix before any model is built or plan composed."""
    world_size = check_world_size(world_size)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError("steps", steps, "a positive int: the training steps measured after the warm-up")
    if device not in DEVICES:
        raise ConfigError("device", device, " or ".join(DEVICES))
    if criterion is not None and not callable(criterion):
        raise ConfigError("criterion", type(criterion).__name__, "None or a function (output, targets) -> loss")
    if step_time not in (True, False, RUNTIME_ESTIMATOR):
        raise ConfigError("step_time", step_time, f"True (priced on paper on CUDA), False, or {RUNTIME_ESTIMATOR!r}")
    return world_size


@dataclass
class Target:
    """The plan twice (:func:`resolve_target`): composed for the device asked for, which is what is
    checked and priced, and for the fake CPU world it is simulated in (compile is never run on fake
    tensors: the step is simulated eagerly and priced by the fusion rule)."""

    #: the plan as a dict, and the objects of a plan given as an object (its own names, see core.codec)
    data: dict
    own: tuple
    target_plan: Plan
    sim_env: Environment
    sim_plan: Plan
    hardware: Any
    nodes: int | None
    #: priced on paper (a GPU's figures), or with this CPU's calibration (``modelled``), or neither
    on_paper: bool
    modelled: bool
    setting: Any
    calibration: Any
    #: DDP's buckets counted the whole step (CUDA's allocator) or from the backward on (the CPU trial)
    whole_step: bool


def resolve_target(plan, world_size: int, device: str, step_time, hardware, nodes, calibration, notes) -> Target:
    """The plan composed for the target and for the simulation, with the hardware and the pricing
    they need; a world size or node count the plan cannot use is refused here, before any work."""
    data = as_plan_dict(plan)
    # a plan handed over as an object names its own classes: read back against them (core.codec)
    own = () if not isinstance(plan, Plan | Transform) else (plan if isinstance(plan, Plan) else compose(plan))
    own = own.named_objects() if own else ()
    on_paper = step_time is True and device == "cuda"
    hw = target_hardware(hardware) if on_paper or hardware is not None else None
    nodes = check_nodes(nodes, world_size, hw)
    here = Environment.detect().with_(world_size=world_size, nodes=nodes)
    capability = (hw.compute_capability if hw else (8, 0)) if device == "cuda" else None
    target_env = (
        here.with_(hardware=hw)
        if here.device == device
        else here.with_(device=device, compute_capability=capability, hardware=hw)
    )
    target_plan = compose_for(data, target_env, own)
    sim_env = here.with_(device="cpu", compute_capability=None)
    sim_plan = compose_for(data, sim_env, own)
    refuse_undeclared(sim_plan)
    if target_plan.names != sim_plan.names:
        notes.append(
            f"on {device} the plan has steps {list(target_plan.names)}; simulated on the CPU: {list(sim_plan.names)}"
        )
    if device != "cpu":
        notes.append(
            "simulated with fake CPU tensors: the CUDA caching allocator's rounding and fragmentation, "
            "cuBLAS/NCCL workspaces and the CUDA context are not counted"
        )
    modelled = bool(step_time) and device == "cpu"
    if modelled and calibration is None:
        from composable_atorch.estimate.calibrate import calibration as cached

        calibration = cached()
    setting = paper.setting_for(target_plan, hw, world_size, nodes) if on_paper else None
    # DDP's gradient buckets (the contract's grad_copies) live in its C++ reducer from its
    # construction on: on CUDA max_memory_allocated counts them the whole step (added to the peak
    # here); the CPU trial's MemTracker first sees them when the backward writes into them, so on
    # the CPU the simulation holds them from the backward on (simulate.buckets_from_backward)
    whole_step = device == "cuda"
    return Target(
        data, own, target_plan, sim_env, sim_plan, hw, nodes, on_paper, modelled, setting, calibration, whole_step
    )


def simulate_runs(target: Target, model, batch: tuple, sim_kw: dict, dedup, notes: list[str]) -> list:
    """The runs that stand for every rank: rank 0 (or one rank per pipeline stage, in stage order),
    each priced on paper where asked. Where it is cheaper they are extrapolated (:mod:`.dedup`): from
    fewer micro-steps of the same plan (a linear pipeline schedule, accumulation), and without a
    pipeline from truncated copies of the model's repeated blocks. ``batch``: (shapes, global batch)."""

    def simulate(rank: int, model=model, plan=target.sim_plan, shapes=batch[0], rows=batch[1], mailbox=None):
        run = simulate_rank(
            plan,
            model,
            shapes,
            global_batch=rows,
            rank=rank,
            buckets_in_backward=not target.whole_step,
            mailbox=mailbox,
            trace_ops=paper.OrderedTrace if target.on_paper else target.modelled,
            cuda=target.target_plan.env.device == "cuda",
            **sim_kw,
        )
        if target.on_paper:
            run.paper = paper.price_run(run, target.setting)
        return run

    stages = layout_degrees(target.sim_plan).get("pipeline", 1)

    def run_set(**kw):
        if stages > 1:
            return dd.whole_stages(simulate, **kw)
        one = functools.partial(simulate, **kw)
        return [dd.shallow_run(one, model, dedup, notes) or one(0)]

    compose_sim = functools.partial(compose_for, env=target.sim_env, allow=target.own)
    runs = dd.micro_window(run_set, target.data, compose_sim, batch, stages, dedup, notes) or run_set()
    if stages > 1:
        notes.append(dd.stage_note(len(runs)))
    for name in runs[0].skipped:
        notes.append(f"{name} cannot run in the fake world: left out, its cost added from its contract")
    return runs


def memory_report(runs: list, target: Target, world_size: int, notes: list[str]) -> tuple[list[RankCost], dict]:
    """Each rank's cost (its stage's run under a pipeline, rank 0's otherwise) and the tracker's
    categories for ``extra``; DDP's buckets join the peak for the span the target counts them."""
    run = runs[0]
    costs = [to_rank_cost(r.by_kind, r.extra_temporary if target.whole_step else 0, stage=r.stage) for r in runs]
    ranks = [costs[s] for s in run.stage_of_rank] if run.stage_of_rank is not None else [costs[0]] * world_size
    extra: dict = {"memtracker": run.by_kind}
    if run.extra_temporary:
        extra["ddp_bucket_bytes"] = run.extra_temporary
        notes.append(
            f"DDP's gradient buckets ({run.extra_temporary / 2**20:.1f} MiB) are in the peak "
            + (
                "for the whole step (allocated when DDP is built)"
                if target.whole_step
                else "from the backward on (where the CPU trial's MemTracker first sees them; on CUDA: the whole step)"
            )
        )
    if len(runs) > 1:
        extra["memtracker_by_stage"] = [r.by_kind for r in runs]
    return ranks, extra


def step_timing(runs: list, target: Target, model, batch: tuple, notes: list[str], extra: dict):
    """``(timing, utilization)``: priced on paper for a GPU, or with this machine's calibration on
    the CPU (with the sequence split's traffic line), or ``(None, None)``."""
    if target.on_paper:
        return paper_step(runs, target.setting, model, batch[0], batch[1], notes, extra)
    if not target.modelled:
        return None, None
    timing = modelled_step_time(runs, target.calibration, target.target_plan.env.world_size)
    notes.append(
        f"step time: the simulated step's ops priced with this machine's calibration "
        f"(compute {timing.compute:.4f} s, comm {timing.comm:.4f} s, overhead {timing.overhead:.4f} s"
        + (f", pipeline bubble {timing.bubble:.4f} s" if timing.bubble else "")
        + ")"
    )
    from composable_atorch.estimate.steptime import sequence_note

    # an extrapolated run holds the attention calls of a truncated model: no line rather than a short one
    line = None if runs[0].extrapolated else sequence_note(runs[0].sequence, target.calibration)
    if line is not None:
        notes.append(line)
        extra["sequence_traffic"] = line
    return timing, None


def no_step_time_reason(step_time, device: str) -> str:
    """Why the estimate has no step time (``extra['step_time_reason']``)."""
    if step_time is False:
        return "step_time=False"
    if device == "cuda":
        return "torch's RuntimeEstimator needs a CUDA device (none here)"
    return "torch's RuntimeEstimator models CUDA devices only"


def refuse_undeclared(plan: Plan) -> None:
    """An EstimateError, before any work, for a plan with a step that cannot run on fake tensors and
    declares no cost to add in its place (``Cost(simulated=False)`` alone: DeepSpeed's engines): the
    figure without it would not be the plan's."""
    left = [t.describe() for t in plan.transforms if not t.contract.cost.simulated and not t.contract.cost.grad_copies]
    if left:
        raise EstimateError(
            f"the estimate cannot simulate {', '.join(left)}",
            "its engine does not run on fake tensors and its contract declares no cost to add in its place",
            "measure the plan (a trial; the search does so by itself), or estimate the nearest plan it can "
            "simulate (DeepSpeed's ZeRO stages: the torch backends zero1() / zero2() / fsdp())",
        )


def compile_notes(run, modelled: bool, on_paper: bool = False) -> list[str]:
    """What the estimate assumed of the plan's compile steps (simulated eagerly, see ``steptime.Fusion``;
    on paper ``paper/fusion.py``)."""
    notes = []
    for regions in run.compiled:
        if on_paper:
            priced = (
                "priced on paper by its fusion rule (estimate/paper/fusion.py: each run of memory-bound ops between "
                "matmuls, attention and collectives one kernel)"
            )
        elif not modelled:
            eager = run.step_time_s is not None
            priced = "the step time is the eager step's" if eager else "the step time is not modelled here"
        elif not regions.fuses:
            priced = "its backend fuses nothing: priced as the eager step"
        else:
            t = run.trace
            priced = (
                f"priced as fused: the {t.fused_ops} memory-bound ops run inside compiled modules counted as "
                f"{t.fused_kernels} kernels, each moving its largest op's bytes and paying the per-op cost once; "
                "matmuls, attention and collectives unchanged"
            )
        notes.append(
            f"{regions.what}: simulated eagerly (the compiler is not run on fake tensors); {priced}. Memory: the "
            "eager step's activations (inductor's partitioner recomputes cheap ops in the backward rather than "
            "save them, which usually saves a little: for that part the figure is usually an upper bound)"
        )
    return notes


MODELLED = "calibrated op trace (composable_atorch.estimate.steptime)"
PAPER = "op trace priced on paper (composable_atorch.estimate.paper)"
RUNTIME_ESTIMATOR = "runtime-estimator"


def modelled_step_time(runs, cal, world_size: int):
    """The slowest simulated stage's step time: its traced ops priced, DDP's all-reduce added, a
    pipeline's bubble applied (:mod:`.steptime`)."""
    from composable_atorch.estimate.steptime import StepTime, bubble_factor, ddp_allreduce

    times = []
    for r in runs:
        parts = r.trace.price(cal, world_size)
        parts["comm"] += ddp_allreduce(r.allreduce_buckets, cal, world_size)
        stages = len(runs) if r.stage is not None else 1
        times.append(StepTime.of(parts, bubble_factor(stages, r.micro_batches)))
    return max(times, key=lambda t: t.seconds)


def to_rank_cost(by_kind: dict[str, int], extra_temporary: int = 0, stage: int | None = None) -> RankCost:
    fields = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporary"), 0)
    for kind, n in by_kind.items():
        if kind in _KINDS:
            fields[_KINDS[kind]] += int(n)
    fields["temporary"] += int(extra_temporary)
    return RankCost(
        **fields,
        peak=int(by_kind.get("Total", sum(fields.values()) - extra_temporary)) + int(extra_temporary),
        stage=stage,
    )


def max_or_none(values) -> Any:
    """The largest of the values given (a pipeline's slowest stage sets the step), None if none is known."""
    known = [v for v in values if v is not None]
    return max(known) if known else None

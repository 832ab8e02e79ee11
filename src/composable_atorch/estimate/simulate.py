"""One rank of a plan in a fake world: fake tensors, torch's fake process group, torch's MemTracker.

Why simulate instead of adding up formulas: the transforms are torch's own engines (FSDP2, DTensor
tensor parallel, composable checkpoint, autocast), and what they keep alive at the peak depends on
their hooks and on the order of frees — a formula per transform would drift from the engine.
Here the real engines run on ``FakeTensorMode`` tensors (shapes, dtypes and storages, no data, no
memory) over torch's fake process group (collectives are no-ops, shapes and placements real), and
the very tracker the trial worker measures with (``torch.distributed._tools.MemTracker``) sees the
peak of one training step. Steps whose contract says they cannot run there (``Cost.simulated``:
DDP's C++ reducer needs real storage) are left out and their cost is added from the contract.
A pipeline stage trains through torch's schedule, as :func:`composable_atorch.train_step` trains
it; what that needs on the fake group is in :mod:`.pipeline`.

The process group is global state: the simulation needs this process to have none (it makes a
fake one and destroys it after). The device mesh is built outside the fake mode (it reads its rank
table's values); only the training step runs under it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import DataLoader

from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import ApplyContext, TrainState
from composable_atorch.errors import CompositionError, ConfigError
from composable_atorch.estimate.inputs import EstimateError, default_loss, fake_batch, make_optimizer, materialize
from composable_atorch.estimate.kernels import fake_grouped_mm, flash_lower_right
from composable_atorch.estimate.pipeline import (
    NEEDS_CRITERION,
    Mailbox,
    criterion_loss,
    schedule_step,
    split_batch,
    wire,
)
from composable_atorch.estimate.steptime import OpTrace, recorded_attention, runtime_of
from composable_atorch.runtime.optim import PlanOptimizer, parameter_names, rebuild_optimizer


@dataclass
class RankRun:
    """What one simulated rank measured (bytes by MemTracker category at the peak)."""

    by_kind: dict[str, int]
    peak: int
    micro_batch: int
    micro_batches: int
    grad_bytes: int
    flops: int | None = None
    step_time_s: float | None = None
    step_time_mode: str | None = None
    skipped: list[str] = field(default_factory=list)
    extra_temporary: int = 0
    #: under a pipeline: the stage this rank holds, and every rank's stage (index = global rank)
    stage: int | None = None
    stage_of_rank: list[int] | None = None
    #: the step's ops (``steptime.OpTrace``) when traced, and the all-reduce buckets of steps the
    #: fake world left out (DDP's gradient all-reduce, one per bucket per optimizer step)
    trace: Any = None
    allreduce_buckets: list[int] = field(default_factory=list)
    #: a sequence split's ``(kind, rotation, degree, [steptime.AttendCall])`` of the traced step
    sequence: Any = None
    #: the plan's compile steps (``transforms.compile.CompiledRegions``), simulated eagerly
    compiled: list = field(default_factory=list)
    #: the step priced on paper (``estimate.paper.RankStep``), where the estimate prices one
    paper: Any = None
    #: extrapolated from runs of fewer blocks or micro-steps (``estimate.dedup``)
    extrapolated: bool = False


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """torch's fake process group of ``world_size`` as ``rank``, destroyed on exit (one adapter for
    the private testing API)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise EstimateError(
            "estimate() needs a process without a process group (it simulates the ranks on torch's fake one)",
            f"this process already has a {dist.get_backend()} group of {dist.get_world_size()}",
            "call estimate() before init_process_group, or in a separate process (it allocates nothing real)",
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    forget_meshes()
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Clear DTensor's caches of sharding decisions. They are keyed by the DeviceMeshes involved, and
    a DeviceMesh compares equal to another of the same shape and names whatever its rank and process
    groups: without this, a rank simulated after another of the same layout got that rank's mesh
    back in its op outputs, and collectives on process groups of a world already destroyed (a
    tensor x pipeline plan failed on its second stage; the trace counted groups of the wrong rank)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()


@contextlib.contextmanager
def no_compiler():
    """torch.compile switched off while a rank is simulated: a compiled function or module (the
    user's own, one a library compiles inside its forward) runs its eager code. Compiling on fake
    tensors would generate and run real kernels for them (inductor's CPU kernels crashed the
    process there); the plan's own compile step is priced instead (``steptime.Fusion``).

    Also held back here: the trackers' "Module is None. Skipping PRE_BW hook" (torch's ModTracker,
    for a module collected before its backward ran: BERT, T5), a note about the simulation's own
    bookkeeping that the user's console has no use for."""
    import warnings

    import torch._dynamo

    with torch._dynamo.config.patch(disable=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
        yield


class _NoHook:
    def remove(self) -> None:
        pass


def frozen_safe_tracker():
    """torch's MemTracker, kept from hooking frozen parameters (LoRA's base weights): before each
    module's forward it registers a gradient hook on every parameter the module holds (under FSDP
    the freshly unsharded ones too), and ``register_hook`` raises on one without
    ``requires_grad``. A placeholder handle marks those as hooked already (one adapter for the
    tracker's private table).

    Only the global peak is kept (all the estimate and the trial read): torch's tracker also updates
    every module's own peak on every op, scanning all the modules it has seen each time, which made
    a pipeline stage's step (hundreds of modules, a hundred thousand ops) spend most of its time there."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            if install_grad_hooks:
                for p in module.parameters():
                    if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                        self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return Tracker()


@dataclass
class Applied:
    """The plan's steps applied in the fake world (:func:`apply_plan`)."""

    model: Any
    optim: PlanOptimizer
    loader: Any
    #: the steps left out (their contract's ``Cost(simulated=False)``) and the gradient copies they declare
    skipped: list[str]
    grad_copies: float
    #: the parallel context (its layout says which pipeline stage each rank holds)
    parallel: Any
    #: what each compile step would compile (``transforms.compile.CompiledRegions``): simulated eagerly
    compiled: list[Any]


def apply_plan(plan: Plan, model, optim, loader) -> Applied:
    """Plan.apply's loop in the fake world. Steps whose contract says they cannot be simulated are
    left out; a compiler (``Cost.compiles``) is not run: the step stays eager and the regions it would
    compile are kept for the step-time model. A step that fails on fake tensors is an EstimateError
    naming it."""
    state = TrainState(model=model, optim=optim, loader=loader, param_names=parameter_names(model, optim))
    ctx = ApplyContext(plan=plan, env=plan.env, strict=plan.strict)
    skipped, grad_copies, compiled = [], 0.0, []
    for step in plan.steps:
        cost = step.transform.contract.cost
        if not cost.simulated:
            if cost.grad_copies and getattr(state.parallel, "data_size", None) == 1:
                # ddp over a data dimension of 1 (a context / Ulysses / model-parallel layout) leaves the
                # model as it is: no reducer, no buckets
                continue
            skipped.append(step.transform.describe())
            grad_copies += cost.grad_copies
            continue
        if cost.compiles:
            compiled.append(step.transform.regions(state.model))
            continue
        try:
            state = step.transform.apply(state, ctx.for_step(step.transform))
        except (CompositionError, NotImplementedError):  # typed already: a refusal naming its fix
            raise
        except Exception as exc:  # noqa: BLE001 - name the step that cannot run here
            raise EstimateError(
                f"the plan's step {step.transform.describe()} cannot be applied on fake tensors",
                exc,
                "measure the plan instead (a trial), or estimate the nearest plan whose steps run on fake tensors",
            ) from exc
        if isinstance(state.optim, torch.optim.Optimizer):
            state.optim = rebuild_optimizer(state.optim, state.param_names, state.model)
    optim = PlanOptimizer(state.optim, state.hooks, parallel=state.parallel, runner=state.runner)
    return Applied(state.model, optim, state.loader, skipped, grad_copies, state.parallel, compiled)


def _bucketed(trained: list[torch.Tensor], parallel) -> list[torch.Tensor]:
    """The trained parameters in ddp's buckets (the copy a contract's ``grad_copies`` prices): all
    but the experts expert_parallel keeps out of ddp's replicate (their own hook averages them)."""
    experts = () if parallel is None or parallel.experts is None else parallel.experts.modules
    kept_out = {id(p) for m in experts for p in m.parameters()}
    return [p for p in trained if id(p) not in kept_out]


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


@dataclass
class RankSetup:
    """One rank's plan applied in the fake world, with what its training step needs
    (:func:`setup_rank`): the step, the tracked steps and the :class:`RankRun` read it."""

    applied: Applied
    #: samples per loader batch and loader batches per optimizer step (before a pipeline's split)
    micro: int
    micro_steps: int
    #: this rank's pipeline stage and every rank's (None without a pipeline)
    stage: int | None
    stage_of_rank: list[int] | None
    #: the trained parameters in ddp's buckets, the copies of them a skipped ddp keeps, their gradients' bytes
    bucketed: list[torch.Tensor]
    grad_copies: float
    grad_bytes: int


def simulate_rank(
    plan: Plan,
    model: torch.nn.Module,
    batch: Any,
    *,
    global_batch: int,
    rank: int,
    loss_fn=None,
    optimizer=None,
    warmup: int | None = None,
    steps: int = 1,
    step_time: bool = False,
    buckets_in_backward: bool = True,
    criterion=None,
    mailbox: Mailbox | None = None,
    trace_ops: bool | type = False,
    cuda: bool = False,
) -> RankRun:
    """Simulate ``rank`` of ``plan`` (composed for the fake world's size) on a fresh copy of the
    model's shapes; the model passed in is not changed. ``steps``: training steps tracked after the
    ``warmup`` (default :data:`WARMUP`; the peak is their maximum; 2 counts what one step leaves
    alive into the next, which a tracker started at the second step cannot see).
    ``buckets_in_backward``: the contract's extra gradient copies join the simulated step from the
    backward on (as the CPU trial sees them, :func:`buckets_from_backward`); False leaves them to the
    caller (``extra_temporary``). A pipeline stage trains through its schedule with
    ``criterion(output, targets)``; ``mailbox`` carries the stage metadata from the stages simulated
    before (:mod:`.pipeline`). ``trace_ops``: the last tracked step also records its ops for the
    step-time model (:mod:`.steptime`); a trace class (``paper.OrderedTrace``) records them with it.
    ``cuda``: a CUDA target's kernels where they differ from the CPU's (:mod:`.kernels`)."""
    loss_fn = loss_fn or (criterion_loss(criterion) if criterion is not None else default_loss)
    with fake_world(plan.env.world_size, rank), no_compiler():
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        setup = setup_rank(plan, model, optimizer, global_batch, rank, criterion, mailbox, fake)
        with fake, fake_grouped_mm(), flash_lower_right(cuda):
            step = training_step(setup, batch, global_batch, loss_fn, criterion, buckets_in_backward)
            warm_up(step, WARMUP if warmup is None else warmup)
            run = tracked_run(setup, step, steps, trace_ops)
            if step_time:
                run.step_time_s, run.step_time_mode = runtime_of(step)
        return run


def setup_rank(plan: Plan, model, optimizer, global_batch: int, rank: int, criterion, mailbox, fake) -> RankSetup:
    """The plan applied to a fake copy of the model and its optimizer for ``rank``: the copy is made
    on meta (the caller's model stays as it is) and materialized as fake tensors; a pipeline stage's
    runner is wired to the mailbox the stages before wrote into."""
    import copy

    with torch.device("meta"):
        model = copy.deepcopy(model) if any(True for _ in model.parameters()) else model
    with fake:
        materialize(model)
        optim = make_optimizer(optimizer, model)
    loader = DataLoader(range(global_batch), batch_size=global_batch)
    applied = apply_plan(plan, model, optim, loader)
    stage = stage_of_rank = None
    runner = applied.optim.runner
    if runner is not None:
        if criterion is None:
            raise ConfigError("criterion", None, NEEDS_CRITERION)
        wire(runner, mailbox if mailbox is not None else Mailbox())
        stage_of_rank = [applied.parallel.layout.coordinate(r, "pipeline") for r in range(plan.env.world_size)]
        stage = stage_of_rank[rank]
    trained = [p for p in applied.model.parameters() if p.requires_grad]
    return RankSetup(
        applied=applied,
        micro=int(getattr(applied.loader, "batch_size", None) or global_batch),
        micro_steps=int(getattr(applied.optim, "accumulation_steps", 1)),
        stage=stage,
        stage_of_rank=stage_of_rank,
        bucketed=_bucketed(trained, applied.parallel),
        grad_copies=applied.grad_copies,
        grad_bytes=sum(local_bytes(p) for p in trained),
    )


def training_step(setup: RankSetup, batch, global_batch: int, loss_fn, criterion, buckets_in_backward: bool):
    """One optimizer step of the rank as ``train_step`` runs it, as a function of the micro-step hook
    (the tracker resets its per-module stats there). The batch is made once, as fake tensors, and
    cut to this rank's part of every sequence where a sequence split's loader does so."""
    model, optim, runner = setup.applied.model, setup.applied.optim, setup.applied.optim.runner
    inputs = fake_batch(batch, global_batch, setup.micro)
    shard = getattr(getattr(setup.applied.loader, "collate_fn", None), "shard", None)
    if shard is not None:  # a sequence split (context / Ulysses): this rank's part of every sequence
        inputs = shard(inputs)
    copies = setup.grad_copies if buckets_in_backward else 0.0
    stage_inputs, targets = split_batch(inputs) if runner is not None else (None, None)

    def step(before_micro=None):
        if runner is not None:  # the schedule runs forward and backward over its micro-batches
            schedule_step(runner, stage_inputs, targets, criterion)
            optim.step()
            optim.zero_grad()
            return
        for _ in range(setup.micro_steps):
            if before_micro is not None:
                before_micro()
            loss = loss_fn(model, inputs)
            if isinstance(loss, list | tuple):
                loss = loss[0]
            with buckets_from_backward(setup.bucketed, copies):
                optim.backward(loss)
                optim.step()
            optim.zero_grad()

    return step


def warm_up(step, n: int) -> None:
    """``n`` untracked steps (what every later step finds alive: optimizer states, lazy inits); a
    step that cannot run on fake tensors is an EstimateError naming what to pass instead."""
    try:
        for _ in range(n):
            step()
    except (EstimateError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - name what failed
        raise EstimateError(
            "one training step of the plan cannot run on fake tensors",
            exc,
            "pass loss_fn=(model, batch) -> loss (or criterion=(output, targets) -> loss) matching your "
            "batch, and keep the forward free of value-dependent Python control flow (.item(), "
            "data-dependent shapes)",
        ) from exc


def tracked_run(setup: RankSetup, step, steps: int, trace_ops: bool | type) -> RankRun:
    """``steps`` steps under torch's MemTracker, the last one also traced: a trace holds no tensor
    (sizes and ids only), so the tracker's peak is the same with it, and a step is saved. The trace
    counts the FLOPs (torch's FlopCounterMode is not used: its module tracker keeps block inputs
    alive to the backward); the paper's ordered trace (a class given as ``trace_ops``) fuses by its
    own rule (paper/fusion.py), a plain OpTrace by the compiled regions."""
    applied, runner = setup.applied, setup.applied.optim.runner
    tracker = frozen_safe_tracker()
    tracker.track_external(applied.model, getattr(applied.optim, "optimizer", applied.optim))
    fused = [m for r in applied.compiled if r.fuses for m in r.modules]
    trace = trace_ops() if callable(trace_ops) else OpTrace(fused if trace_ops else ())
    attends = recorded_attention(applied.model) if trace_ops else contextlib.nullcontext()
    with per_call_stats(tracker, applied.model if runner is not None else None), tracker:  # as the worker: reset first
        for _ in range(steps - 1):
            step(before_micro=tracker.reset_mod_stats)
        with trace, attends as sequence:
            step(before_micro=tracker.reset_mod_stats)
    by_kind: dict[str, int] = {}
    for dev_snap in tracker.get_tracker_snapshot("peak").values():
        for kind, n in dev_snap.items():
            key = kind if isinstance(kind, str) else kind.value
            by_kind[key] = by_kind.get(key, 0) + int(n)
    micro, micro_steps = setup.micro, setup.micro_steps
    if runner is not None:
        micro, micro_steps = micro // runner.microbatches, runner.microbatches
    return RankRun(
        by_kind=by_kind,
        peak=by_kind.get("Total", 0),
        micro_batch=micro,
        micro_batches=micro_steps,
        grad_bytes=setup.grad_bytes,
        flops=int(trace.flops()),
        skipped=applied.skipped,
        extra_temporary=int(setup.grad_copies * sum(local_bytes(p) for p in setup.bucketed)),
        stage=setup.stage,
        stage_of_rank=setup.stage_of_rank,
        trace=trace if trace_ops else None,
        allreduce_buckets=[b for _, b in bucket_sizes(setup.bucketed, 1.0)] if setup.grad_copies > 0 else [],
        sequence=sequence,
        compiled=applied.compiled,
    )


@contextlib.contextmanager
def per_call_stats(tracker, stage):
    """A pipeline schedule calls its stage once per micro-batch inside one step, which MemTracker's
    per-module stats refuse: reset them before each call (enter before the tracker, so this global
    hook runs before its own; the global peak survives the resets). The trial worker's measurement
    (``auto.worker.peak_bytes_of_step``) uses it too."""
    if stage is None:
        yield
        return
    from torch.nn.modules.module import register_module_forward_pre_hook

    def reset(module, _args):
        if module is stage:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(reset)
    try:
        yield
    finally:
        handle.remove()


#: warm-up steps before the tracked ones: the first step builds what every later step finds alive
#: (the optimizer's states, FSDP's lazy init, a pipeline stage's buffers). The trial measures after
#: two; the simulated peaks after one and after two were equal on every plan family checked (fsdp,
#: ddp, zero1/2, selective and full checkpointing, tensor, pipeline, tensor x pipeline, context,
#: LoRA, seed 002's loop keeping outputs across steps), and one saves a step of every simulation
WARMUP = 1

#: DDP's bucket caps (torch's defaults): the first bucket 1 MiB, the rest 25 MiB
BUCKET_CAPS = (2**20, 25 * 2**20)


def bucket_sizes(params: list[torch.Tensor], copies: float) -> list[tuple[int, int]]:
    """``(index of the first parameter whose gradient is ready, bytes)`` per bucket: parameters in
    the order their gradients are ready (reverse registration, as DDP's rebuilt buckets), filled up
    to torch's default caps, times the contract's ``copies``."""
    out, size, first = [], 0, None
    for i in range(len(params) - 1, -1, -1):
        first = i if first is None else first
        size += local_bytes(params[i])
        if size >= BUCKET_CAPS[0 if not out else 1]:
            out.append((first, int(size * copies)))
            size, first = 0, None
    if size:
        out.append((first, int(size * copies)))
    return out


@contextlib.contextmanager
def buckets_from_backward(params: list[torch.Tensor], copies: float):
    """Stand-in for buffers a step left out of the fake world (DDP's gradient buckets, the contract's
    ``grad_copies``): each bucket is a fake tensor made when the gradient of its first parameter
    is ready, held to the end of the block (the optimizer step).

    Why from the backward: DDP's reducer allocates its buckets when it is built, before a tracker
    starts, so torch's MemTracker (the trial's measurement on the CPU) first sees a bucket when the
    backward writes a ready gradient into it; from then on it counts in the peak. A plan whose peak
    is in the backward (checkpointing) carries them; one whose peak ends the forward does not.
    On CUDA ``max_memory_allocated`` counts them the whole step (:func:`~.core.estimate` adds them)."""
    held: list = []
    handles = []
    if copies > 0:
        for first, nbytes in bucket_sizes(params, copies):

            def make(_param, nbytes=nbytes):
                held.append(torch.empty(nbytes, dtype=torch.uint8, device=_param.device))

            handles.append(params[first].register_post_accumulate_grad_hook(make))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        held.clear()

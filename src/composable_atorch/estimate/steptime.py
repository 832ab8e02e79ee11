"""A plan's step time from the simulated step's per-op trace, priced with this machine's calibration.

The estimate already runs one training step of the plan's real engines on fake tensors
(:mod:`.simulate`); :class:`OpTrace` watches that step's dispatched ops and keeps, per op, what it
costs: FLOPs for matmuls and attention (torch's own flop formulas), bytes moved for everything else,
and bytes of the full tensor for each collective. Whatever the plan does shows up there by itself:
checkpointing's recomputed forward (the engine reruns it), autocast's casts and bf16 matmuls, the
micro-steps of accumulation, FSDP's all-gathers and reduce-scatters, ZeRO's broadcasts, the
optimizer's foreach updates. What the fake world cannot run is added from the step's contract:
DDP's gradient all-reduce (``Cost.grad_copies``: its buckets, one all-reduce each per optimizer
step). A pipeline stage's trace holds its micro-batches; the schedule's bubble stretches it by
``(m + p - 1) / m`` (GPipe / 1F1B, ``p`` stages, ``m`` micro-batches).

Pricing (:meth:`OpTrace.price`): each op costs its calibrated curve at its size (:mod:`.calibrate`;
the curves' floors hold the call cost of a tiny op), plus the framework's per-op cost (autograd,
module hooks); collectives over a group of ``w`` ranks (the group each op ran over, so a hybrid
plan's zero-group gathers and replica all-reduces are priced at their own sizes) read the world-2
curves at the ring-equivalent size (all-reduce moves ``2(w-1)/w`` of the tensor per rank,
all-gather / reduce-scatter ``(w-1)/w``; an all-to-all, Ulysses' exchange, on the all-gather curve
at its ring-equivalent size). A point-to-point send of ``B`` bytes costs half of a world-2
all-gather of ``2B``; a receive beside a send of its size (the ring attention's exchange, 1F1B's
batched send/receive) is in that price. On the CPU nothing is overlapped: gloo's thread
competes with the compute for the same cores. A sequence split's traffic is also counted by hand
from its attention calls (:func:`sequence_traffic`) for the estimate report's line. A compiled
plan's step is simulated eagerly (no compiler runs on fake tensors) and its compiled regions are
priced by :class:`Fusion`'s rule.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from composable_atorch.estimate.kernels import GROUPED, grouped_flops

#: ops that move no data (views, metadata, bookkeeping): no kernel and no framework cost counted
FREE = {
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "t",
    "transpose",
    "permute",
    "expand",
    "as_strided",
    "detach",
    "alias",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "device",
    "_record_function_enter_new",
    "_record_function_exit",
    "wait_tensor",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_same_size",
    "_local_scalar_dense",
}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "convolution_backward", "_scaled_mm"}
SDPA_CPU = "_scaled_dot_product_flash_attention_for_cpu"


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sum_bytes(x) -> int:
    return sum(_nbytes(t) for t in tree_flatten(x)[0])


def _collective(name: str) -> str | None:
    n = name.replace("_", "")
    if "allreduce" in n:
        return "all_reduce"
    if "allgather" in n:
        return "all_gather"
    if "broadcast" in n:
        return "broadcast"
    if "reducescatter" in n:
        return "reduce_scatter"
    if "alltoall" in n:
        return "all_to_all"
    if n == "send":
        return "p2p"
    if n in ("recv", "recvanysource"):
        return "p2p_recv"
    return None


def _group_size(args) -> int | None:
    """The size of the process group a c10d op runs over (its ProcessGroup arrives as a ScriptObject)."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # a ReduceOp, or another script object
                continue
    return None


class OpTrace(TorchDispatchMode):
    """Counts the ops of what runs under it: ``(kind, dtype, size) -> calls`` (see the module doc).

    ``fused``: the modules a fusing compiler (inductor) compiles; the step runs eagerly and their
    ops are counted as compiled (:class:`Fusion`)."""

    #: whether calls are kept for re-running (:meth:`price` on this CPU); a trace priced on declared
    #: hardware (``paper.OrderedTrace``) never re-runs its ops here and keeps none
    records_replays: ClassVar[bool] = True

    def __init__(self, fused=()):
        super().__init__()
        self.ops: Counter = Counter()
        self.op_count = 0
        self.fusion = Fusion(fused) if fused else None
        #: memory-bound ops of compiled regions, and the fused kernels they were counted as
        self.fused_ops = self.fused_kernels = 0
        #: ``(key in ops, op, kernels.op_spec) -> calls``: what an estimate on this CPU may re-run
        #: to price the op at its own shapes (:meth:`price`); eager kernels only, not fused runs
        self.replays: Counter = Counter()

    def __enter__(self):
        if self.fusion is not None:
            self.fusion.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self.fusion is not None:
            self.fusion.tracker.__exit__(*exc)
            self._close_run()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self.record(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a shape the formulas do not know: counted as memory traffic
            self.ops[("memory", "", float(_sum_bytes((args, kwargs, out))))] += 1
        return out

    def record(self, func, args, kwargs, out) -> None:
        packet = getattr(func, "overloadpacket", None)
        name = getattr(packet, "__name__", str(func))
        if name in FREE:
            return
        ns = getattr(func, "namespace", "")
        comm = _collective(name) if ns in ("c10d", "_c10d_functional", "c10d_functional") else None
        region = self.fusion.region() if self.fusion is not None else None
        if comm is not None:
            self._close_run()
            size = max(_sum_bytes(args[:1]), _sum_bytes(args[1:2]), _sum_bytes(out))
            group = _group_size(args)  # hybrid sharding: a zero group's gathers, a replica group's all-reduce
            self.ops[(comm, str(group) if group else "", float(size))] += 1
            return
        first = next((t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else ""
        sdpa = name.startswith("_scaled_dot_product") or name == SDPA_CPU + "_backward"
        if name in MATMULS or name in GROUPED or sdpa:
            flops = _flops(packet, name, args, kwargs, out)
            if flops:
                kind = "mm"
                if "scaled_dot_product" in name:
                    # a causal mask is priced as the full attention: measured here, the CPU kernels
                    # took no less time for it
                    kind = "sdpa_bwd" if name.endswith("_backward") else "sdpa"
                self._close_run()  # a compiler calls the matmul kernels as they are: the same FLOPs
                self._count((kind, dtype, float(flops)), func, args, kwargs)
                return
        size = float(_sum_bytes((args, out)))
        if region:
            self._extend_run(region, dtype, size)
            return
        self._close_run()
        self._count(("memory", dtype, size), func, args, kwargs)

    def _count(self, key, func, args, kwargs) -> None:
        from composable_atorch.estimate.kernels import op_spec

        self.op_count += 1
        self.ops[key] += 1
        spec = op_spec(args, kwargs) if self.records_replays else None
        if spec is not None:
            self.replays[(key, func, spec)] += 1

    def _extend_run(self, region, dtype: str, size: float) -> None:
        """A memory-bound op of a compiled region joins the run of such ops it follows (:class:`Fusion`)."""
        run = self.fusion.run
        if run is not None and run[0] != region:
            self._close_run()
            run = None
        self.fused_ops += 1
        self.fusion.run = (region, dtype, size) if run is None or size > run[2] else run

    def _close_run(self) -> None:
        """The open run of fused ops, priced as one kernel moving its largest op's bytes."""
        if self.fusion is None or self.fusion.run is None:
            return
        _, dtype, size = self.fusion.run
        self.fusion.run = None
        self.fused_kernels += 1
        self.op_count += 1
        self.ops[("memory", dtype, size)] += 1

    def price(self, cal, world: int = 2, replay: bool | None = None) -> dict[str, float]:
        """Seconds by part: ``compute`` (kernels), ``comm`` (collectives), ``overhead`` (framework per op).

        ``replay`` (default: where the calibration is a replay one of this CPU,
        ``Calibration.replays_here``): a kernel whose curve price is small is re-run here at its own
        shapes (``kernels.replay_seconds``) and priced at what it took."""
        parts = {"compute": 0.0, "comm": 0.0, "overhead": self.op_count * cal.per_op_s}
        ops = Counter(self.ops)
        if replay if replay is not None else cal.replays_here():
            parts["compute"] += self._replayed(cal, ops)
        for (kind, dtype, size), n in ops.items():
            if kind == "p2p_recv":  # a receive running beside a send of its size is in the send's price
                n = max(0, n - self.ops.get(("p2p", dtype, size), 0))
            # a collective's key holds its group's size where the trace saw it (else the whole world)
            comm = kind in COMM_KINDS
            w = int(dtype) if comm and dtype.isdigit() else world
            parts["comm" if comm else "compute"] += n * price_op(cal, kind, "" if comm else dtype, size, w)
        return parts

    def _replayed(self, cal, ops: Counter) -> float:
        """Seconds of the kernels re-run here; their calls leave ``ops`` (priced by curve no more)."""
        from composable_atorch.estimate.kernels import REPLAY_MAX_S, replay_seconds

        threads, seconds = int(cal.machine.get("threads", 1)), 0.0
        for (key, func, spec), n in self.replays.items():
            n = min(n, ops[key])
            if n <= 0 or price_op(cal, *key) > REPLAY_MAX_S:
                continue
            took = replay_seconds(func, spec, threads)
            if took is not None:
                seconds += n * took
                ops[key] -= n
        return seconds

    def flops(self) -> int:
        return int(sum(size * n for (kind, _, size), n in self.ops.items() if kind in ("mm", "sdpa", "sdpa_bwd")))


class Fusion:
    """Where a fusing compiler's regions are while the eager step runs, and the run of fused ops open.

    The rule (inductor, the one fusing backend): inside a compiled module's forward or backward, a
    run of consecutive memory-bound ops (elementwise, reductions, casts, norms) with no matmul,
    attention or collective between them is one generated kernel. Such a kernel reads its inputs
    and writes its outputs once, so it is priced as moving the bytes of the run's largest op (each
    of whose tensors the fused kernel still reads or writes at least once), and it pays the
    framework's per-op cost once. Matmuls and attention keep their FLOPs and their price (the
    compiler calls the same kernels); ops outside the regions (the embedding, the loss, FSDP's
    hooks, the optimizer step) are priced as eager. A rule, not a fit: it is a floor on the fused
    kernel's traffic and says nothing about autotuning or CUDA graphs (``mode``).

    Where a module runs (its forward, its backward, a checkpoint's recompute) is read from torch's
    ``ModTracker``."""

    def __init__(self, modules):
        from torch.distributed._tools.mod_tracker import ModTracker

        self.ids = {id(m) for m in modules}
        self.names: set[str] = set()
        self.tracker = ModTracker()
        self.tracker.register_user_hooks(pre_fw_hook=self._seen)
        #: the open run: (region names it is in, dtype and bytes of its largest op), or None
        self.run = None

    def _seen(self, module, _inputs) -> None:
        if id(module) in self.ids:
            self.names.add(self.tracker.get_known_fqn(module))

    def region(self) -> frozenset | None:
        """The compiled modules running now (forward or backward), None outside all of them."""
        inside = self.names.intersection(self.tracker.parents)
        return frozenset(inside) if inside else None


COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "p2p_recv", "broadcast")


def ring_factor(kind: str, world: int) -> float:
    """Bytes a rank moves in a ring collective at ``world``, relative to world 2 (the calibration's)."""
    if world <= 1:
        return 0.0
    # all-reduce: 2(w-1)/w of 1; all-gather, reduce-scatter: (w-1)/w of 1/2; an all-to-all of a
    # rank's S bytes sends (w-1)/w of S and receives as much: a world-2 all-gather of 2(w-1)/w S
    return 2.0 * (world - 1) / world


def price_op(cal, kind: str, dtype: str, size: float, world: int = 2) -> float:
    if kind in ("mm", "sdpa", "sdpa_bwd"):
        # an attention backward falls back to the forward's curve in calibrations made before it had its own
        names = [f"{kind}_{dtype}", f"{kind}_float32"] + (
            [f"sdpa_{dtype}", "sdpa_float32"] if kind == "sdpa_bwd" else []
        )
        return cal.curve(next(n for n in names if n in cal.curves))(size)
    if kind in ("p2p", "p2p_recv"):  # a send of B bytes: half of a world-2 all-gather of 2B moves B each way
        return cal.curve("all_gather")(2 * size)
    if kind == "all_to_all":  # priced on the all-gather curve (the calibration has no all-to-all of its own)
        return cal.curve("all_gather")(size * ring_factor(kind, world))
    if kind == "broadcast":  # a rank receives the whole tensor at any world (pipelined); older calibrations
        # have no broadcast curve: the all-gather's at the same bytes
        return cal.curve("broadcast" if "broadcast" in cal.curves else "all_gather")(size)
    if kind in COMM_KINDS:
        return cal.curve(kind)(size * ring_factor(kind, world))
    return cal.curve("memory")(size)


def _flops(packet, name, args, kwargs, out) -> float:
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

    if name in GROUPED:
        return grouped_flops(name, args)
    if name == SDPA_CPU:
        return sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
    if name == SDPA_CPU + "_backward":
        return sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
    formula = flop_registry.get(packet)
    return formula(*args, **kwargs, out_val=out) if formula is not None else 0.0


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on one rank, and what they are made of."""

    seconds: float
    compute: float
    comm: float
    overhead: float
    #: a pipeline's idle time (the schedule's bubble); 0 without a pipeline
    bubble: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, parts: dict[str, float], bubble_factor: float = 1.0) -> StepTime:
        busy = parts["compute"] + parts["comm"] + parts["overhead"]
        return cls(busy * bubble_factor, parts["compute"], parts["comm"], parts["overhead"], busy * (bubble_factor - 1))


def ddp_allreduce(bucket_bytes: list[int], cal, world: int) -> float:
    """DDP's gradient all-reduce (not run in the fake world): one all-reduce per bucket per optimizer step."""
    return sum(price_op(cal, "all_reduce", "", float(b), world) for b in bucket_bytes)


def bubble_factor(stages: int, microbatches: int) -> float:
    """GPipe / 1F1B: ``p - 1`` idle slots of ``m + p - 1`` per step."""
    return (microbatches + stages - 1) / microbatches if stages > 1 and microbatches >= 1 else 1.0


@dataclass(frozen=True)
class AttendCall:
    """One attention call of a sequence split as the simulated step made it: this rank's bytes of
    its queries and keys (values are the keys' shape) and their head counts."""

    q_bytes: int
    k_bytes: int
    q_heads: int
    k_heads: int
    elements_k: int  # elements of the keys (the ring's key/value gradients travel in fp32)


def sequence_traffic(kind: str, rotation: str, n: int, calls: list[AttendCall]) -> list[tuple[str, float, int]]:
    """``(collective, bytes, calls)`` one rank runs per step for a sequence split's attention (forward
    and backward), counted from the attention calls: what ``OpTrace`` sees of those calls, by hand.

    * context, all-gather rotation: forward all-gathers keys and values (``n`` x local each, the
      key/value heads before repetition); backward all-reduces their gradients (the same size);
    * context, ring: keys and values (repeated to the query heads) move on ``n - 1`` times forward
      and ``n - 1`` times backward, their fp32 gradients ``n`` times; each send has a matching receive;
    * Ulysses: four all-to-alls forward (queries, keys, values to heads; the output back to the
      sequence) and four backward (keys and values repeated first when their heads do not divide by ``n``).
    """
    out: Counter = Counter()
    if n <= 1:
        return []
    for c in calls:
        if kind == "context" and rotation == "ring":
            kv = c.k_bytes * c.q_heads // c.k_heads
            grad = c.elements_k * c.q_heads // c.k_heads * 4
            for op in ("p2p", "p2p_recv"):
                out[(op, float(kv))] += 2 * 2 * (n - 1)
                out[(op, float(grad))] += 2 * n
        elif kind == "context":
            out[("all_gather", float(n * c.k_bytes))] += 2
            out[("all_reduce", float(n * c.k_bytes))] += 2
        else:
            kv = c.k_bytes if c.k_heads % n == 0 else c.k_bytes * c.q_heads // c.k_heads
            out[("all_to_all", float(c.q_bytes))] += 2 * 2  # queries and the output, forward and backward
            out[("all_to_all", float(kv))] += 2 * 2  # keys and values, forward and backward
    return sorted((op, size, k) for (op, size), k in out.items())


def price_traffic(traffic: list[tuple[str, float, int]], cal, world: int) -> float:
    """Seconds of ``traffic`` (:func:`sequence_traffic`) as :meth:`OpTrace.price` prices the same ops."""
    trace = OpTrace()
    for op, size, k in traffic:
        trace.ops[(op, str(world), size)] += k
    return trace.price(cal, world)["comm"]


def sequence_note(sequence, cal) -> str | None:
    """The estimate report's line on a sequence split's traffic (``RankRun.sequence``), or None."""
    if sequence is None or not sequence[3]:
        return None
    kind, rotation, n, calls = sequence
    traffic = sequence_traffic(kind, rotation, n, calls)
    sent = sum(size * k for op, size, k in traffic if op != "p2p_recv")
    what = {
        ("context", "allgather"): f"keys/values all-gathered (forward) and their gradients all-reduced (backward) "
        f"in each of {len(calls)} attention calls",
        ("context", "ring"): f"key/value blocks sent {n - 1} times forward and backward, their gradients {n} times, "
        f"in each of {len(calls)} attention calls",
    }.get((kind, rotation), f"4 all-to-alls forward and 4 backward in each of {len(calls)} attention calls")
    name = f"context {n} ({rotation})" if kind == "context" else f"Ulysses sequence {n}"
    return (
        f"{name}: {what}: {sent / 2**20:.2f} MiB per rank per step, "
        f"{price_traffic(traffic, cal, n):.4f} s of the step's comm"
    )


@contextlib.contextmanager
def recorded_attention(model):
    """A sequence split's attention calls while the block runs, as ``(kind, rotation, degree, calls)``
    (None without a split): the sizes its collectives move are counted from them
    (``steptime.sequence_traffic``). The split's one attention object is switched to a recording
    subclass for the block, and back."""
    from composable_atorch.transforms.parallel.sequence.loss import SPLIT_ATTR

    attend = getattr(model, SPLIT_ATTR, None)
    if attend is None or getattr(attend, "n", 1) <= 1:
        yield None
        return
    calls: list[AttendCall] = []
    base = type(attend)

    def call(self, q, k, v, **kw):
        calls.append(AttendCall(_local_bytes(q), _local_bytes(k), q.size(1), k.size(1), k.numel()))
        return base.__call__(self, q, k, v, **kw)

    attend.__class__ = type("Recorded" + base.__name__, (base,), {"__call__": call})
    try:
        yield (attend.kind, attend.rotation, attend.n, calls)
    finally:
        attend.__class__ = base


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def runtime_of(step) -> tuple[float | None, str | None]:
    """torch's RuntimeEstimator (roofline cost model) over one step; it needs a CUDA device."""
    if not torch.cuda.is_available():
        return None, None
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    mode = "operator-level-cost-model"
    try:
        est = RuntimeEstimator()
        with est(estimate_mode_type=mode):
            step()
        return est.total_runtime / 1e3, f"torch RuntimeEstimator {mode}"
    except Exception:  # noqa: BLE001 - no estimate rather than a wrong one
        return None, None

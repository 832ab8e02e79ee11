"""Fast estimates of deep models: the repeated blocks simulated at two small depths, the rest extrapolated.

A transformer's layers are copies of one block (same class, same parameter shapes), and everything
the estimate measures grows by the same amount per layer: parameters, gradients and optimizer
states per block, the activations a block keeps for the backward (or its boundary under
checkpointing), FSDP's per-block all-gathers and reduce-scatters, the ops and FLOPs of its forward
and backward. So a model of ``n`` blocks costs ``q(k1) + (n - k1) * (q(k2) - q(k1))`` for each such
quantity ``q``, measured on copies of the model truncated to ``k1`` and ``k2`` blocks. Two depths,
not one, so that what is not per block (embeddings, the head, the loss, the first and last block's
edge effects such as FSDP's root) is measured rather than assumed; ``k1 = 2`` keeps a first and a
last block apart from each other. A third depth checks the line: where the peak moves from one
phase of the step to another as blocks are added (DDP's buckets filling up, a checkpointed
backward overtaking the optimizer step), the bytes at the third depth are off the line and the
whole model is simulated instead. A 32-layer Llama is simulated as 2 + 3 + 4 layers.

Pipeline plans are not truncated (their stage cut depends on the depth), nor plans with DDP (its
gradient buckets, added as stand-ins, are filled across blocks up to 25 MiB each, so what of them
is alive at the peak is not per block): they are simulated whole.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace

import torch

from composable_atorch.estimate.inputs import rebatched
from composable_atorch.estimate.pipeline import Mailbox
from composable_atorch.estimate.simulate import BUCKET_CAPS, RankRun
from composable_atorch.estimate.steptime import OpTrace

#: the first depths simulated (the third checks the line through the first two), the deepest the
#: window slides to (then 2 + 3 + 4 + 5 + 6 = 20 blocks have been simulated), and the depth from
#: which truncating pays (9 blocks simulated when the first window holds)
DEPTHS = (2, 3, 4)
LAST_DEPTH = 6
AUTO_FROM = 8


def _signature(module: torch.nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def find_blocks(model: torch.nn.Module) -> tuple[str, int] | None:
    """``(qualified name, count)`` of the model's longest ModuleList / Sequential of identical blocks, or None."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList | torch.nn.Sequential) or len(module) < 2:
            continue
        children = list(module)
        first = _signature(children[0])
        if not first[1] or any(_signature(c) != first for c in children[1:]):
            continue
        if best is None or len(children) > best[1]:
            best = (name, len(children))
    return best


def truncated(model: torch.nn.Module, name: str, depth: int) -> torch.nn.Module:
    """A copy of ``model`` (meta) whose block list ``name`` keeps its first ``depth`` blocks; a config
    saying how many layers there are (Hugging Face's ``num_hidden_layers``, ``n_layer``) says so too."""
    with torch.device("meta"):
        out = copy.deepcopy(model)
    parent_name, _, attr = name.rpartition(".")
    parent = out.get_submodule(parent_name) if parent_name else out
    blocks = getattr(parent, attr) if attr else out
    n = len(blocks)
    kept = type(blocks)(list(blocks)[:depth]) if attr else None
    if attr:
        setattr(parent, attr, kept)
    for config in {id(c): c for c in (getattr(m, "config", None) for m in out.modules()) if c is not None}.values():
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if getattr(config, key, None) == n:
                setattr(config, key, depth)
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and len(types) == n:
            config.layer_types = types[:depth]
    return out


def _line(a: float, b: float, k1: int, k2: int, n: int) -> float:
    return a + (n - k1) * (b - a) / (k2 - k1)


def _int_line(a: int, b: int, k1: int, k2: int, n: int) -> int:
    return max(0, round(_line(a, b, k1, k2, n)))


def _counts_line(small: Counter, large: Counter, k1: int, k2: int, n: int) -> Counter:
    """Each key's count at ``n`` blocks on the line through its counts at ``k1`` and ``k2``."""
    counts = Counter()
    for key in set(small) | set(large):
        count = _int_line(small.get(key, 0), large.get(key, 0), k1, k2, n)
        if count:
            counts[key] = count
    return counts


def extrapolate(small: RankRun, large: RankRun, k1: int, k2: int, n: int) -> RankRun:
    """The run of the ``n``-block model from the runs of its ``k1``- and ``k2``-block copies."""
    kinds = set(small.by_kind) | set(large.by_kind)
    by_kind = {k: _int_line(small.by_kind.get(k, 0), large.by_kind.get(k, 0), k1, k2, n) for k in kinds}
    trace = None
    if small.trace is not None and large.trace is not None:
        trace = OpTrace()
        trace.ops = _counts_line(small.trace.ops, large.trace.ops, k1, k2, n)
        trace.replays = _counts_line(small.trace.replays, large.trace.replays, k1, k2, n)
        trace.op_count = _int_line(small.trace.op_count, large.trace.op_count, k1, k2, n)
        trace.fused_ops = _int_line(small.trace.fused_ops, large.trace.fused_ops, k1, k2, n)
        trace.fused_kernels = _int_line(small.trace.fused_kernels, large.trace.fused_kernels, k1, k2, n)
    total = _int_line(sum(small.allreduce_buckets), sum(large.allreduce_buckets), k1, k2, n)
    buckets = []
    while total > 0:  # DDP's buckets of the whole model: the first up to 1 MiB, the rest up to 25 MiB
        cap = BUCKET_CAPS[0 if not buckets else 1]
        buckets.append(min(cap, total))
        total -= buckets[-1]
    return replace(
        large,
        extrapolated=True,
        by_kind=by_kind,
        peak=by_kind.get("Total", 0),
        grad_bytes=_int_line(small.grad_bytes, large.grad_bytes, k1, k2, n),
        flops=None if small.flops is None else _int_line(small.flops, large.flops, k1, k2, n),
        extra_temporary=_int_line(small.extra_temporary, large.extra_temporary, k1, k2, n),
        trace=trace,
        allreduce_buckets=buckets,
        paper=None if small.paper is None or large.paper is None else small.paper.extrapolate(large.paper, k1, k2, n),
        step_time_s=None
        if small.step_time_s is None or large.step_time_s is None
        else max(0.0, _line(small.step_time_s, large.step_time_s, k1, k2, n)),
    )


def shallow_run(simulate, model, dedup: bool | None, notes: list[str]):
    """Rank 0's run extrapolated from truncated copies of the model (:mod:`.dedup`), or None when the
    model has no repeated blocks worth it, ``dedup`` is False, or no three consecutive depths up to
    ``dedup.LAST_DEPTH`` lie on one line (the memory peak kept moving from one phase of the step to
    another as blocks were added: then the whole model is simulated). The window of depths slides
    one block deeper at a time: a peak in the backward of the first interior block needs a first,
    an interior and a last block apart at every depth of the window (a context split's backward
    peaks in its second block)."""
    found = find_blocks(model) if dedup is not False else None
    if found is None or found[1] <= DEPTHS[-1] or (dedup is None and found[1] < AUTO_FROM):
        return None
    name, n = found
    runs = {}
    for depth in range(DEPTHS[0], min(LAST_DEPTH, n - 1) + 1):
        runs[depth] = simulate(0, truncated(model, name, depth))
        if runs[depth].allreduce_buckets:  # DDP's bucket stand-ins: their layout over the parameters is not per block
            notes.append(f"{n} identical blocks: DDP's gradient buckets span blocks, so the whole model is simulated")
            return None
        window = tuple(range(depth - len(DEPTHS) + 1, depth + 1))
        if window[0] < DEPTHS[0]:
            continue
        (k1, k2, k3), (small, large, check) = window, [runs[k] for k in window]
        if extrapolate(small, large, k1, k2, k3).by_kind == check.by_kind:
            notes.append(
                f"{n} identical blocks in {name or 'the model'}: simulated with {', '.join(map(str, runs))} blocks "
                f"(the line through {k1} and {k2} holds at {k3}), extrapolated per block"
            )
            return extrapolate(large, check, k2, k3, n)
    notes.append(
        f"{n} identical blocks: the memory peak moves with depth up to {max(runs)} blocks, so the whole model is "
        "simulated"
    )
    return None


def whole_stages(simulate, mailbox: Mailbox | None = None, **kw) -> list[RankRun]:
    """One simulated rank per pipeline stage, in stage order (each reads the metadata the stage
    before sent: ``mailbox``); rank 0 holds stage 0 of any layout."""
    mailbox = mailbox if mailbox is not None else Mailbox()
    runs = [simulate(0, mailbox=mailbox, **kw)]
    for s in range(1, max(runs[0].stage_of_rank) + 1):
        runs.append(simulate(runs[0].stage_of_rank.index(s), mailbox=mailbox, **kw))
    return runs


def micro_window(run_set, data: dict, compose, batch, stages: int, dedup: bool | None, notes: list[str]):
    """The runs of a plan repeating ``m`` micro-steps per optimizer step (a 1F1B or GPipe pipeline's
    micro-batches, ``accumulate``'s steps), extrapolated from the same plan run with ``k``, ``k + 1``,
    ``k + 2``... micro-steps (``k``: the stages of a pipeline, 2 for accumulation) while that is fewer
    in all; None where it is not, or where no window of them lies on a line.

    Why it holds: every micro-step runs the same ops (the trace and the FLOPs grow by one
    micro-step's worth each), and the memory is what the loop keeps between them: the gradients
    from the first micro-step on, and a schedule's activations in flight (flat or one micro-batch's
    worth more per micro-batch once the schedule reaches its steady state). Memory equal at ``k``
    and ``k + 1`` is that flat line, and two runs do; otherwise a third checks the line through the
    first two, and the window slides one micro-step on while it does not hold (a 2-stage 1F1B's first
    stage reaches its line at 3 micro-batches, not 2). ``run_set(plan=, shapes=, rows=)`` simulates a
    composed plan on a batch of ``rows`` samples and returns its runs (one per pipeline stage);
    ``batch``: ``(shapes, global batch)``; ``compose(data)`` composes a plan dict for the simulation."""
    shapes, rows = batch
    found = repeated_steps(data, stages)
    if dedup is False or found is None:
        return None
    m, first, what = found
    if 2 * first + 1 >= m or rows % m:
        return None

    def runs(k: int) -> list[RankRun]:
        return run_set(
            plan=compose(with_repeats(data, k)), shapes=rebatched(shapes, rows, rows // m * k), rows=rows // m * k
        )

    done = {first: runs(first), first + 1: runs(first + 1)}
    if any(r.allreduce_buckets for r in done[first + 1]):
        return None
    if all(a.by_kind == b.by_kind for a, b in zip(done[first], done[first + 1], strict=True)):
        notes.append(
            f"{what} simulated with {first} and {first + 1} micro-steps (the same memory) and extrapolated to {m}"
        )
        return [
            replace(extrapolate(a, b, first, first + 1, m), micro_batches=m)
            for a, b in zip(*done.values(), strict=True)
        ]
    k3 = first + 2
    while sum(done) + k3 < m:
        done[k3] = runs(k3)
        k1, k2 = k3 - 2, k3 - 1
        lined = zip(done[k1], done[k2], done[k3], strict=True)
        if all(extrapolate(a, b, k1, k2, k3).by_kind == c.by_kind for a, b, c in lined):
            notes.append(
                f"{what} simulated with {', '.join(map(str, done))} micro-steps (the line through {k1} and {k2} "
                f"holds at {k3}) and extrapolated to {m}"
            )
            return [
                replace(extrapolate(b, c, k2, k3, m), micro_batches=m) for b, c in zip(done[k2], done[k3], strict=True)
            ]
        k3 += 1
    notes.append(f"{what}: all {m} micro-steps simulated (the memory was off the line over {first}..{k3 - 1} of them)")
    return None


def repeated_steps(data: dict, stages: int) -> tuple[int, int, str] | None:
    """``(micro-steps, first of the window, what)`` of a plan dict repeating micro-steps linearly
    (:func:`micro_window`), None for one that does not (an interleaved or zero-bubble schedule)."""
    for t in data.get("transforms") or ():
        config = t.get("config") or {}
        if isinstance(config.get("microbatches"), int) and "schedule" in config and stages > 1:
            if config["schedule"] not in LINEAR_SCHEDULES:
                return None
            return config["microbatches"], stages, f"the {config['schedule']} schedule"
        if t.get("name") == "accumulate" and isinstance(config.get("steps"), int):
            return config["steps"], 2, "gradient accumulation"
    return None


def with_repeats(data: dict, k: int) -> dict:
    """The plan dict with its micro-steps (:func:`repeated_steps`) set to ``k``."""
    out = copy.deepcopy(data)
    for t in out.get("transforms") or ():
        config = t.get("config") or {}
        if isinstance(config.get("microbatches"), int) and "schedule" in config:
            config["microbatches"] = k
        elif t.get("name") == "accumulate" and isinstance(config.get("steps"), int):
            config["steps"] = k
    return out


#: schedules whose per-stage cost is linear in the micro-batches from ``m = p`` on (see :func:`pipeline_runs`)
LINEAR_SCHEDULES = ("1F1B", "GPipe")


def stage_note(n: int) -> str:
    return (
        f"pipeline: {n} stages, one rank simulated per stage (tensor and data ranks of a stage hold "
        "equal shares); stage metadata handed on in stage order (the fake group's P2P carries no values)"
    )

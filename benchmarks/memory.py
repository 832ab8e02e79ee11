"""Per-rank training-state memory of ddp / zero1 / zero2 / fsdp and of model-parallel layouts (TP, PP,
TP x FSDP, TP x PP x DP), and activation memory with checkpointing.

    python benchmarks/memory.py [--worlds 2 4] [--fake-worlds 8 16 64] [--no-model-parallel] \
        [--d-model 128] [--n-layer 4]

State bytes are counted exactly, per rank, after one real training step on a gloo process group
of N spawned processes: the local bytes of every parameter (a DTensor's local shard), of every
gradient, and of every tensor in the optimizer state (a ZeRO-1 optimizer's local partition).
DDP's reducer buckets, which hold another copy of the gradients, are not counted.

Activation bytes are measured on the built-in GPT in one process, two ways (CPU_FACTS):
``saved``: bytes of the tensors autograd saves for backward (a saved_tensors_hooks counter, one
count per storage); ``profiler``: the net CPU memory the forward leaves allocated, summed over
``torch.profiler`` ops with ``profile_memory=True`` (it also sees what checkpointing keeps
outside autograd, such as the blocks' inputs).

Model-parallel layouts (issue 10; see the section below for how each row is counted): a tiny
Llama on gloo at ``--worlds`` and a Llama-2-7B-shaped model on the meta device under torch's fake
process group at ``--fake-worlds``.

Targets: fsdp's state bytes per rank <= (1/N + 5%) of ddp's; every model-parallel row's params,
grads and AdamW state equal the plan's arithmetic; the fake-group way gives the gloo bytes
exactly. Prints tables with PASS/FAIL per target and writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import composable_atorch
import composable_atorch.cli.estimate

RESULTS = Path(__file__).parent / "results" / "memory.json"
PLANS = ("ddp", "zero1", "zero2", "fsdp")
TOLERANCE = 0.05


def make_plan(name: str):
    import composable_atorch as ca
    from composable_atorch.models import Block

    return {
        "ddp": lambda: ca.ddp(),
        "zero1": lambda: ca.ddp() | ca.zero1(),
        "zero2": lambda: ca.zero2(),
        "fsdp": lambda: ca.fsdp(wrap=Block),
        "none": lambda: ca.compose(),
    }[name]()


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds for ``t`` (a DTensor's local shard, not its global size)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optim) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer-state bytes of a (transformed) model and optimizer."""
    inner = getattr(optim, "optimizer", optim)
    inner = getattr(inner, "optim", inner)  # ZeRO-1: this rank's partition lives in the local optimizer
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer = sum(local_bytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def build(cfg: dict, batch: int):
    from composable_atorch.data import TextDataset
    from composable_atorch.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=cfg["seq_len"], d_model=cfg["d_model"], n_layer=cfg["n_layer"], n_head=4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TextDataset(cfg["seq_len"], limit=4 * batch), batch_size=batch)
    return model, optim, loader


def one_step_state(plan_name: str, cfg: dict, batch: int) -> dict[str, int]:
    """Apply the plan, train one step, and count the state (gradients kept: measured before zero_grad)."""
    from composable_atorch.models.gpt import lm_loss

    model, optim, loader = make_plan(plan_name)(*build(cfg, batch))
    x, y = next(iter(loader))
    optim.backward(lm_loss(model(x), y))
    optim.step()
    return state_bytes(model, optim)


def activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """Bytes the forward keeps for backward: autograd-saved tensors, and the profiler's net allocation."""
    from torch.profiler import ProfilerActivity, profile

    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    del out
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(tokens)
    net = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    del out
    return {"saved": sum(seen.values()), "profiler": int(net)}


# -- model-parallel layouts (issue 10): TP, PP, 2-D and 3-D ----------------------------------------
#
# A layout family is one function (the plan steps for a layout) plus one row list (its degrees at
# every world size) in FAMILIES. The same rows run two ways:
#   gloo  a tiny Llama, real spawned processes, one real step (backward + AdamW): all measured;
#   meta  a Llama built on the meta device under torch's fake process group (FakeStore, backend
#         "fake": shapes and per-rank bytes are real, collectives no-ops). Parameters are measured
#         (DTensor local shards); gradients are zeros_like(parameter), i.e. laid out like the shard
#         they belong to (FSDP2 and TP keep gradients so; no backward runs on meta); the AdamW state
#         is measured after a real optimizer step on meta. Pipelining does not run on the fake group,
#         so a pipeline's stage is computed: this rank keeps the parameters (measured shards) of the
#         stage the library's own cut puts it in (PipelineParallel.cuts: anatomy + balanced_cuts).
# The meta way also runs the gloo rows on the tiny model, and the table says whether it matched.

#: Llama-2-7B's published shape, as ``--model llama-7b`` names it
LLAMA_7B = {**composable_atorch.cli.estimate.LLAMA_7B, "tie_word_embeddings": False}
LLAMA_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=512,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
FAKE_WORLDS = (8, 16, 64)
MICROBATCHES = 2
#: one stage per rank (the pipeline rows' stage is the rank's whole share)
SCHEDULE = "1F1B"
#: measured per-rank params / grads / AdamW bytes must equal the plan's arithmetic within this
#: (chunks round up; AdamW step counters)
CHECK_TOLERANCE = 0.005


@dataclass(frozen=True)
class Layout:
    """Degrees of one row: ``tensor x pipeline x data`` ranks of the ``family``'s plan."""

    family: str
    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data

    def groups(self) -> list[tuple[str, int]]:
        """parallel_mode's groups (the seed's order, tensor fastest); the data dimension always given."""
        return [(n, s) for n, s in (("tensor", self.tensor), ("pipeline", self.pipeline)) if s > 1] + [
            ("data", self.data)
        ]

    @property
    def microbatches(self) -> int:
        """1F1B needs at least one microbatch per stage."""
        return max(MICROBATCHES, self.pipeline)

    @property
    def label(self) -> str:
        data = f"{FAMILIES[self.family].data_label}{self.data}" if self.data > 1 else ""
        parts = [f"tp{self.tensor}" * (self.tensor > 1), f"pp{self.pipeline}" * (self.pipeline > 1), data]
        tag = FAMILIES[self.family].tag if self.family in FAMILIES else ""
        return (" x ".join(p for p in parts if p) or "whole") + (f" ({tag})" if tag else "")


@dataclass(frozen=True)
class Family:
    """A layout family: its plan, its rows, and what its data dimension does to the bytes.

    ``steps(layout, block_class, pipeline_runs)`` -> the plan's transforms; with
    ``pipeline_runs=False`` (the fake group) the same layout without pipeline stages, whose stage
    the benchmark then cuts. ``data_shards``: which of params / grads / optimizer the data
    dimension divides (the rest it replicates); the check column expects exactly that.
    ``data_label``: how the data degree is written in row labels (``dp4``, ``fsdp4``).
    ``measure(layout, sizes)``: a family whose engine builds and counts its own way (DeepSpeed's
    pipeline engine builds each stage itself and keeps its partitions elsewhere) gives the function
    a gloo rank runs instead of :func:`gloo_layout_state`; it returns the same keys (``steps`` may
    then be None). ``on_fake=False``: the plan cannot run on the fake process group, so its rows at
    fake worlds are left out (and said so) and no meta cross-check is made.
    """

    steps: Callable[[Layout, type, bool], tuple] | None
    rows: tuple[tuple[int, int, int], ...]  # (tensor, pipeline, data) at every world size
    data_shards: tuple[str, ...] = ()
    data_label: str = "dp"
    measure: Callable[[Layout, dict], dict] | None = None
    on_fake: bool = True
    tag: str = ""  # shown after the degrees in a row's label (e.g. the engine), so labels stay unique
    #: a family whose sharding is not the torch-native plan's (DeepSpeed's own stage cut, Megatron-style
    #: TP with a vocabulary-parallel embedding) is compared with this family's row of the same degrees
    #: instead of with the arithmetic
    compare_to: str | None = None


ALL_STATE = ("params", "grads", "optimizer")


def _fsdp_steps(lay, block, pipeline_runs):
    """FSDP2 over the whole world (data only): the baseline the model-parallel rows are read against."""
    return (composable_atorch.fsdp(wrap=(block,)), composable_atorch.parallel_mode(lay.groups()))


def _tp_steps(lay, block, pipeline_runs):
    """Tensor parallel (HF's own plan via 'auto'); a data dimension replicates (gradients all-reduced)."""
    return (composable_atorch.tensor_parallel(), composable_atorch.parallel_mode(lay.groups()))


def _tp_fsdp_steps(lay, block, pipeline_runs):
    """2-D: tensor parallel on 'tensor', FSDP2 on 'data' (as torchtitan)."""
    return (
        composable_atorch.tensor_parallel(),
        composable_atorch.fsdp(wrap=(block,)),
        composable_atorch.parallel_mode(lay.groups()),
    )


def _pp_steps(lay, block, pipeline_runs):
    """Pipeline stages on 'pipeline' (1F1B), the data dimension replicated; nothing to run on the fake group."""
    pp = composable_atorch.pipeline_parallel(microbatches=lay.microbatches, schedule=SCHEDULE)
    return (pp, composable_atorch.parallel_mode(lay.groups())) if pipeline_runs else ()


def _tp_pp_steps(lay, block, pipeline_runs):
    """3-D with the seed's mixed_parallel: tensor x pipeline x data (replicated)."""
    if pipeline_runs:
        return (
            composable_atorch.mixed_parallel(microbatches=lay.microbatches, schedule=SCHEDULE),
            composable_atorch.parallel_mode(lay.groups()),
        )
    return (composable_atorch.tensor_parallel(), composable_atorch.parallel_mode(lay.groups()))


def _ds3d_measure(lay, sizes):
    """DeepSpeed's pipeline engine builds each stage itself: benchmarks/memory_ds3d.py counts a rank."""
    sys.path.insert(0, str(Path(__file__).parent))
    from memory_ds3d import ds3d_layout_state

    return ds3d_layout_state(lay.tensor, lay.pipeline, lay.data, sizes)


#: A new family: one steps function above and one entry here
#: (rows at gloo worlds run on gloo, the rest on the fake group).
FAMILIES: dict[str, Family] = {
    "fsdp": Family(_fsdp_steps, ((1, 1, 2), (1, 1, 4), (1, 1, 8), (1, 1, 16), (1, 1, 64)), ALL_STATE, "fsdp"),
    "tp": Family(_tp_steps, ((2, 1, 1), (2, 1, 2), (8, 1, 1), (8, 1, 8))),
    "tp_fsdp": Family(
        _tp_fsdp_steps, ((2, 1, 2), (2, 1, 4), (4, 1, 2), (8, 1, 2), (2, 1, 8), (8, 1, 8)), ALL_STATE, "fsdp"
    ),
    "pp": Family(_pp_steps, ((1, 2, 1), (1, 2, 2), (1, 8, 1), (1, 4, 4))),
    "tp_pp": Family(_tp_pp_steps, ((2, 2, 1), (2, 2, 2), (2, 2, 4), (8, 2, 1), (8, 8, 1), (4, 4, 4))),
    # issue 11: ds_3d_parallel on DeepSpeed's PipelineEngine, world 4 only (real collectives needed)
    "ds3d": Family(
        None, ((1, 2, 2), (2, 2, 1)), measure=_ds3d_measure, on_fake=False, tag="deepspeed 3D", compare_to="tp_pp"
    ),
}


def layouts(world: int) -> list[Layout]:
    return [Layout(name, t, p, d) for name, fam in FAMILIES.items() for t, p, d in fam.rows if t * p * d == world]


def llama(sizes: dict, meta: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**sizes))
    return LlamaForCausalLM(LlamaConfig(**sizes))


def _block_class(model) -> type:
    from composable_atorch.transforms.parallel.pipeline.transform import anatomy

    return type(anatomy(model)[0][0])


def stages_of(model: torch.nn.Module, lay: Layout) -> list[set[str]]:
    """Parameter names each pipeline stage keeps, from the cut pipeline_parallel makes (split="auto", 1F1B).

    Blocks go where ``PipelineParallel.cuts`` puts them; parameters before the first block (the
    embeddings) to stage 0, after the last block (final norm, head) to the last stage, as the stage
    cutter does; checked against ``anatomy``'s counts of those.
    """
    from composable_atorch.transforms.parallel.pipeline.transform import PipelineParallel, anatomy

    blocks, head, tail = anatomy(model)
    stages = lay.pipeline
    bounds = (0, *PipelineParallel(microbatches=lay.microbatches, schedule=SCHEDULE).cuts(model, stages), len(blocks))
    owner = {id(p): s for s in range(stages) for b in blocks[bounds[s] : bounds[s + 1]] for p in b.parameters()}
    names: list[set[str]] = [set() for _ in range(stages)]
    extra = [0, 0]
    seen_block = False
    for name, p in model.named_parameters():
        if id(p) in owner:
            seen_block = True
            names[owner[id(p)]].add(name)
        else:
            names[-1 if seen_block else 0].add(name)
            extra[seen_block] += p.numel()
    assert extra == [head, tail], (extra, head, tail)  # the cutter's view of what rides with the first / last stage
    return names


def by_name(model: torch.nn.Module, optim) -> dict[str, tuple[int, int, int]]:
    """Per parameter name: (parameter, gradient, optimizer-state) bytes this rank holds."""
    inner = getattr(optim, "optimizer", optim)
    inner = getattr(inner, "optim", inner)
    out = {}
    for name, p in model.named_parameters():
        state = inner.state.get(p, {})
        opt = sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        out[name] = (local_bytes(p), local_bytes(p.grad) if p.grad is not None else 0, opt)
    return out


def _totals(rows: dict[str, tuple[int, int, int]], names=None) -> dict[str, int]:
    keep = [v for n, v in rows.items() if names is None or n in names]
    params, grads, opt = (sum(v[i] for v in keep) for i in range(3))
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """torch's fake process group of ``world`` ranks in this process (collectives are no-ops)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def meta_sharded(sizes: dict, lay: Layout):
    """(per-name bytes, stage names or None) of rank 0 under ``lay``; call inside fake_world(lay.world)."""
    model = llama(sizes, meta=True)
    stages = stages_of(model, lay) if lay.pipeline > 1 else None
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = FAMILIES[lay.family].steps(lay, _block_class(model), False)
    if steps:
        model, optim, _ = composable_atorch.compose(*steps)(model, optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # laid out like its parameter (a DTensor shard stays a shard)
    optim.step()  # AdamW creates its state on meta, in each parameter's layout
    return by_name(model, optim), stages


def meta_state(sizes: dict, lay: Layout) -> dict:
    """Per-rank bytes of the heaviest rank (pipeline: the heaviest stage), and each stage's."""
    rows, stages = meta_sharded(sizes, lay)
    if stages is None:
        return {**_totals(rows), "source": "meta"}
    per_stage = [_totals(rows, names) for names in stages]
    return {**max(per_stage, key=lambda s: s["total"]), "stages": [s["total"] for s in per_stage], "source": "meta+cut"}


def expected_state(sizes: dict, lay: Layout) -> dict[str, int]:
    """The plan's arithmetic for the heaviest rank's params / grads / AdamW state (the check column).

    Each parameter of the whole model, divided where the plan says: by the tensor degree along
    the dimension TensorParallel.placements shards (colwise: out features, rowwise: in features;
    chunks, so ceil on rank 0), then by the data degree along dim 0 for what the family's data
    dimension shards; summed over the heaviest pipeline stage. Gradients are laid out like the
    parameters, AdamW keeps two of each (its step counters, 4 bytes per tensor, are left out).
    """
    from composable_atorch.transforms.parallel.tensor import TensorParallel

    model = llama(sizes, meta=True)
    shard = TensorParallel().placements(model, lay.tensor)[0] if lay.tensor > 1 else {}
    shards = FAMILIES[lay.family].data_shards if lay.family in FAMILIES else ()
    per_name = {}
    for name, p in model.named_parameters():
        module, attr = name.rsplit(".", 1)
        shape = list(p.shape)
        kind = shard.get(module, (None,))[0]
        dim = {"col": 0, "vocab": 0, "row": 1 if attr == "weight" else None}.get(kind)
        if dim is not None and dim < len(shape):
            shape[dim] = math.ceil(shape[dim] / lay.tensor)
        tp_only = math.prod(shape) * p.element_size()
        shape[0] = math.ceil(shape[0] / lay.data)
        split = math.prod(shape) * p.element_size()
        per_name[name] = {k: (split if k in shards else tp_only) * (2 if k == "optimizer" else 1) for k in ALL_STATE}
    stages = stages_of(model, lay) if lay.pipeline > 1 else [set(per_name)]
    totals = [{k: sum(per_name[n][k] for n in names) for k in ALL_STATE} for names in stages]
    return max(totals, key=lambda t: sum(t.values()))


def check(b: dict, expected: dict) -> str:
    """ "ok" when params, grads and AdamW state each match the plan's arithmetic (within rounding)."""
    bad = [f"{k} {b[k] / expected[k]:.3f}x plan" for k in ALL_STATE if abs(b[k] / expected[k] - 1) > CHECK_TOLERANCE]
    return "ok" if not bad else "; ".join(bad)


def gloo_layout_state(lay: Layout, sizes: dict, seq_len: int = 16) -> dict:
    """Apply the family's plan on this gloo rank, run one real step, count the state (before zero_grad)."""
    from composable_atorch.models.gpt import lm_loss
    from composable_atorch.runtime.train_step import runner_of

    model = llama(sizes, meta=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optim, _ = composable_atorch.compose(*FAMILIES[lay.family].steps(lay, _block_class(model), True))(
        model, optim
    )
    g = torch.Generator().manual_seed(1)  # the same batch on every rank (tensor ranks must agree)
    x, y = (torch.randint(0, sizes["vocab_size"], (2 * MICROBATCHES, seq_len), generator=g) for _ in range(2))
    runner = runner_of(optim)
    if runner is not None:
        runner.step(x, y, lm_loss)
    else:
        optim.backward(lm_loss(model(x).logits, y))
    optim.step()
    return {**state_bytes(model, optim), "source": "gloo"}


# -- distributed part ---------------------------------------------------------------------------
def _rank(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {"dp": {name: one_step_state(name, cfg, batch=2 * world) for name in PLANS}}
        results["mp"] = {lay.label: gloo_measure(lay) for lay in layouts(world) if cfg["model_parallel"]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def gloo_measure(lay: Layout) -> dict:
    """This gloo rank's bytes for one row: the family's own measure, or the plan + one real step."""
    own = FAMILIES[lay.family].measure
    return {"source": "gloo", **own(lay, LLAMA_TINY)} if own is not None else gloo_layout_state(lay, LLAMA_TINY)


def measure_world(world: int, cfg: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "init"), tmp, cfg), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


# -- reporting ------------------------------------------------------------------------------------
KEYS = ("params", "grads", "optimizer", "total")


def whole_state(sizes: dict) -> dict:
    """One process holding the whole model: parameters, gradients and AdamW state (on meta)."""
    model = llama(sizes, meta=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    return {**_totals(by_name(model, optim)), "source": "meta"}


WHOLE = Layout("whole")


def _row(lay: Layout, b: dict, whole: dict, sizes: dict, native: dict | None = None) -> dict:
    """One table row; a family with ``compare_to`` is set beside the torch-native row of its degrees."""
    fam = FAMILIES.get(lay.family)
    extra = {k: b[k] for k in ("stages", "meta_equals_gloo") if k in b}
    row = {
        "world": lay.world,
        "layout": lay.label,
        "family": lay.family,
        **{k: b[k] for k in KEYS},
        "vs_whole": b["total"] / whole["total"],
        "source": b["source"],
        **extra,
    }
    if fam is not None and fam.compare_to:
        if native is None:
            return {**row, "expected": None, "check": "-", "arithmetic": False}
        ratios = ", ".join(f"{k} {b[k] / native[k]:.2f}x" for k in KEYS)
        return {**row, "expected": None, "check": f"vs torch-native: {ratios}", "arithmetic": False}
    expected = expected_state(sizes, lay)
    return {**row, "expected": expected, "check": check(b, expected), "arithmetic": True}


def layout_table(title: str, rows: list[dict], unit: int, unit_name: str, cross_check: bool):
    from rich.table import Table

    table = Table(title=f"{title} ({unit_name}, per rank: the heaviest rank)")
    cols = ["world", "layout", *KEYS, "vs whole", "plan's params", "check", "how"] + (
        ["meta = gloo"] if cross_check else []
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("layout", "check", "how") else "right")
    for r in rows:
        cells = [
            str(r["world"]),
            r["layout"],
            *(f"{r[k] / unit:.3f}" for k in KEYS),
            f"{r['vs_whole']:.3f}",
            f"{r['expected']['params'] / unit:.3f}" if r["expected"] else "-",
            r["check"],
            r["source"],
        ]
        same = {True: "yes", False: "NO", None: "-"}[r.get("meta_equals_gloo")]
        table.add_row(*cells, *([same] if cross_check else []))
    return table


HOW = (
    "how: gloo = spawned gloo processes, one real step (backward + AdamW), all measured; "
    "meta = fake process group, model on the meta device: parameters measured (DTensor local shards), gradients "
    "zeros_like(parameter) in its layout (no backward on meta), AdamW state measured after a step; "
    "meta+cut = the same, the pipeline stage COMPUTED from the cut pipeline_parallel makes (anatomy + balanced_cuts): "
    "pipelining does not run on the fake group. plan's params: the plan's arithmetic (TP-sharded dims / tensor degree, "
    "dim 0 / data degree where fsdp shards). check: params, grads and AdamW state each == the plan's arithmetic "
    "(grads laid out like params, AdamW 2x)."
)


def tp_replicated_bytes(sizes: dict, tensor: int) -> dict[str, int]:
    """Parameters tensor_parallel('auto') leaves whole on every tensor rank: name -> bytes."""
    from composable_atorch.transforms.parallel.tensor import TensorParallel

    model = llama(sizes, meta=True)
    placed = TensorParallel().placements(model, tensor)[0]
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in placed}


def model_parallel_rows(worlds, fake_worlds, gloo_mp: dict) -> dict:
    """The gloo rows (with the meta way's cross-check) and the 7B rows on the fake group."""
    out = {"models": {"gloo": LLAMA_TINY, "fake": LLAMA_7B}, "gloo": [], "fake": [], "not_on_fake": []}
    whole_on_tp = tp_replicated_bytes(LLAMA_7B, 8)
    out["tp_replicated"] = {
        "bytes": sum(whole_on_tp.values()),
        "largest": sorted(whole_on_tp, key=whole_on_tp.get)[-2:],
    }
    tiny_whole, big_whole = whole_state(LLAMA_TINY), whole_state(LLAMA_7B)
    out["gloo"].append(_row(WHOLE, tiny_whole, tiny_whole, LLAMA_TINY))
    for world in worlds:
        with fake_world(world):
            for lay in layouts(world):
                b = dict(gloo_mp[world][lay.label])
                if FAMILIES[lay.family].on_fake:
                    meta = meta_state(LLAMA_TINY, lay)
                    b["meta_equals_gloo"] = all(meta[k] == b[k] for k in KEYS)
                other = FAMILIES[lay.family].compare_to
                twin = Layout(other, lay.tensor, lay.pipeline, lay.data).label if other else None
                out["gloo"].append(_row(lay, b, tiny_whole, LLAMA_TINY, gloo_mp[world].get(twin)))
    out["fake"].append(_row(WHOLE, big_whole, big_whole, LLAMA_7B))
    for world in fake_worlds:
        with fake_world(world):
            for lay in layouts(world):
                if FAMILIES[lay.family].on_fake:
                    out["fake"].append(_row(lay, meta_state(LLAMA_7B, lay), big_whole, LLAMA_7B))
                else:
                    out["not_on_fake"].append(f"{world} {lay.label} ({lay.family})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--fake-worlds", type=int, nargs="*", default=list(FAKE_WORLDS))
    parser.add_argument("--no-model-parallel", action="store_true", help="only the data-parallel GPT rows")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    import composable_atorch as ca
    from composable_atorch.models import Block

    cfg = {
        "d_model": args.d_model,
        "n_layer": args.n_layer,
        "seq_len": args.seq_len,
        "model_parallel": not args.no_model_parallel,
    }
    console = Console(width=200)
    report: dict = {"model": cfg, "state": {}, "activations": {}, "targets": []}
    started = time.perf_counter()
    gloo_mp: dict[int, dict] = {}
    for world in args.worlds:
        per_rank = measure_world(world, cfg)
        # per-rank bytes: the largest rank (shards can differ by padding)
        report["state"][world] = {
            name: {k: max(r["dp"][name][k] for r in per_rank) for k in per_rank[0]["dp"][name]} for name in PLANS
        }
        # model parallel: the heaviest rank (pipeline stages differ), its components
        gloo_mp[world] = {
            label: max((r["mp"][label] for r in per_rank), key=lambda b: b["total"]) for label in per_rank[0]["mp"]
        }

    table = Table(title=f"Per-rank training state, GPT d_model={args.d_model} n_layer={args.n_layer} (MiB)")
    for col in ("world", "plan", "params", "grads", "optimizer", "total", "vs ddp"):
        table.add_column(col, justify="right" if col not in ("plan",) else "left")
    mib = 1 / 2**20
    for world, plans in report["state"].items():
        ddp_total = plans["ddp"]["total"]
        for name, b in plans.items():
            ratio = b["total"] / ddp_total
            table.add_row(
                str(world),
                name,
                *(f"{b[k] * mib:.3f}" for k in ("params", "grads", "optimizer", "total")),
                f"{ratio:.3f}",
            )
        limit = 1 / world + TOLERANCE
        ratio = plans["fsdp"]["total"] / ddp_total
        report["targets"].append(
            {
                "target": f"fsdp <= (1/{world} + 5%) of ddp state bytes",
                "detail": f"fsdp/ddp = {ratio:.3f} (limit {limit:.3f})",
                "pass": ratio <= limit,
            }
        )
    console.print(table)
    console.print(
        "State at rest after a step. zero2 (FSDP2 with reshard_after_forward=False) keeps its parameters "
        "unsharded only between forward and backward, so at rest it equals fsdp."
    )

    if cfg["model_parallel"]:
        mp_report = model_parallel_rows(args.worlds, args.fake_worlds, gloo_mp)
        report["model_parallel"] = mp_report
        tiny = f"Llama hidden {LLAMA_TINY['hidden_size']}, {LLAMA_TINY['num_hidden_layers']} layers, fp32 + AdamW"
        console.print(
            layout_table(f"Model-parallel layouts on gloo, {tiny}", mp_report["gloo"], 2**20, "MiB", cross_check=True)
        )
        console.print(
            layout_table(
                "Llama-2-7B shape (meta device) on the fake process group, fp32 + AdamW",
                mp_report["fake"],
                2**30,
                "GiB",
                cross_check=False,
            )
        )
        console.print(HOW)
        rep = mp_report["tp_replicated"]
        console.print(
            f"tensor_parallel('auto') on HF Llama shards what transformers' tp_plan names (the layers' projections, "
            f"the head with gathered logits; not the embedding, whose DTensor gradient would be replicated); the rest "
            f"stays whole on every tensor rank: {rep['bytes'] / 2**30:.3f} GiB of the 7B's fp32 parameters (largest: "
            f"{', '.join(rep['largest'])})."
        )
        if mp_report["not_on_fake"]:
            console.print(
                "not run on the fake group (the family's engine needs real collectives): "
                f"{', '.join(mp_report['not_on_fake'])}"
            )
        rows = mp_report["gloo"] + mp_report["fake"]
        rows = [r for r in rows if r.get("arithmetic", True)]  # DS 3D rows are compared with torch-native instead
        bad = [f"{r['world']} {r['layout']}: {r['check']}" for r in rows if r["check"] != "ok"]
        report["targets"].append(
            {
                "target": "model-parallel rows: params, grads and AdamW state == the plan's arithmetic",
                "detail": f"{len(rows) - len(bad)}/{len(rows)} rows ok" + (f"; {bad}" if bad else ""),
                "pass": not bad,
            }
        )
        compared = [r for r in mp_report["gloo"] if "meta_equals_gloo" in r]
        differ = [f"{r['world']} {r['layout']}" for r in compared if not r["meta_equals_gloo"]]
        report["targets"].append(
            {
                "target": "the meta / fake-group way gives the gloo bytes exactly (tiny Llama)",
                "detail": f"{len(compared) - len(differ)}/{len(compared)} rows equal"
                + (f"; differ: {differ}" if differ else ""),
                "pass": not differ,
            }
        )

    # activations: one process, with and without checkpointing the blocks
    tokens = torch.randint(0, 256, (8, args.seq_len))
    act = Table(title=f"Activation bytes of one forward (batch 8, seq {args.seq_len}) (MiB)")
    for col in ("plan", "autograd-saved", "profiler net"):
        act.add_column(col, justify="left" if col == "plan" else "right")
    for name, plan in (("none", ca.compose()), ("checkpoint(Block)", ca.checkpoint(Block))):
        model, _, _ = plan(*build(cfg, 8)[:1], None, None)
        report["activations"][name] = activation_bytes(model, tokens)
        act.add_row(name, *(f"{report['activations'][name][k] * mib:.2f}" for k in ("saved", "profiler")))
    console.print(act)
    cut = report["activations"]["none"]["profiler"] / max(1, report["activations"]["checkpoint(Block)"]["profiler"])
    report["activation_reduction_profiler"] = cut

    for t in report["targets"]:
        verdict = "[green]PASS[/green]" if t["pass"] else "[red]FAIL[/red]"
        console.print(f"{verdict}  {t['target']}: {t['detail']}")
    console.print(
        f"checkpointing cuts activation memory {cut:.1f}x (profiler); took {time.perf_counter() - started:.0f} s"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report["state"] = {str(k): v for k, v in report["state"].items()}
    RESULTS.write_text(json.dumps(report, indent=2))
    console.print(f"saved {RESULTS}")
    return 0 if all(t["pass"] for t in report["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())

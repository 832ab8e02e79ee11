"""Tensor parallelism on torch's DTensor ``parallelize_module``: ``tensor_parallel`` and :class:`TPInfo`.

Linear (and HF GPT-2 ``Conv1D``) weights are sharded over the ``tensor`` dimension of the mesh
``parallel_mode`` built: column-parallel layers keep 1/degree of their output features, row-parallel
ones 1/degree of their input features and all-reduce their output (Megatron's split, as torch's
``ColwiseParallel`` / ``RowwiseParallel``). Attention modules are told their heads per rank
("shrink"). Parameter names are kept; parameters become DTensors.

The plan is one of

* ``"auto"``: column-then-row pairs read from one traced forward of a zero-weight replica
  (:mod:`.graph`: q/k/v or a fused qkv -> o, up/gate -> down, fc1 -> fc2, GPT-2's Conv1D, BERT's
  split attention/output modules, a plain chain of Linears, peft LoRA wrappers as one projection:
  :mod:`.lora`), transformers' ``base_model_tp_plan``
  where it is plain colwise/rowwise and places the same layers, head counts divided, fused
  projections strided or kept whole, per-head tables (T5's relative bias) sharded and per-head
  norms' gradients summed; the plan runs once at one rank's shapes before any weight moves, and a
  pair that fails there (a norm over the whole q projection, a short convolution, gated linear
  attention, DeepSeek's low-rank q) is kept whole and named in explain() while the others shard
  (:mod:`.resolve`); a model with no pair, or none that passes, is a
  :class:`TensorParallelPlanError` naming its Linear layers and showing the manual form;
* a :class:`TPInfo` (ATorch's manual form);
* a mapping ``{"blocks.*.attn.q": "colwise", ...}`` (HF's form).

Megatron-style sequence parallelism is this transform with ``sequence_parallel=True``; ATorch's
name ``sequence_parallel`` is Ulysses (``transforms/parallel/sequence``).
Dropout streams follow the plan's ``replic_drop`` / ``parallel_drop``
(see :mod:`.dropout`); fused (strided) layers are checkpointed in the user's unpermuted layout
(see :mod:`.layout`). ``train_step`` averages the loss over the plan's loss group (its data dimension).
Before the probe and the sharding every rank takes the first rank's whole weights (a model built
without a common seed trains as rank 0's, as under ddp / fsdp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.axes import TENSOR
from composable_atorch.transforms.parallel.shared.sync import broadcast_local, parallel_context
from composable_atorch.transforms.parallel.tensor import check, lora
from composable_atorch.transforms.parallel.tensor.dropout import sequence_sliced
from composable_atorch.transforms.parallel.tensor.planner import (
    TensorParallelPlanError,
    TPInfo,
    is_conv1d,
    normalize_plan,
    plan_auto,
)
from composable_atorch.transforms.parallel.tensor.resolve import Placements, keep_failing_pairs, resolve
from composable_atorch.transforms.parallel.tensor.styles import (
    blocks_of,
    conv1d_style,
    drop_note,
    dropout_streams,
    own_output,
    refreeze,
    requires_grad,
    retie,
    sequence_entry_exit,
    stride_perm,
    sum_grads,
    tied_params,
)

# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------


#: measured: ZeroRedundancyOptimizer's broadcast of a DTensor parameter raises NotImplementedError at the first step
ZERO1_CONFLICT = Conflict(
    "zero1",
    "zero1's optimizer broadcasts each parameter from the rank that updated it, and torch has no broadcast rule "
    "for tensor-parallel DTensor parameters (NotImplementedError at the first step)",
    "shard the optimizer state with fsdp() or zero2() (FSDP2 takes DTensors: tensor x data), or drop zero1",
)


@dataclass(frozen=True)
class TensorParallel(Transform):
    """Shard Linear layers over the mesh's ``tensor`` dimension (DTensor ``parallelize_module``).

    ``plan``: ``"auto"``, a :class:`TPInfo`, or ``{pattern: "colwise" | "rowwise" | "vocab"}``.
    ``sequence_parallel=True`` also shards the activations between the sharded layers over the
    sequence (dim 1): the residual stream enters the first transformer block split over the
    sequence, the blocks' norms run on their shard (``SequenceParallel``), row-parallel outputs are
    reduce-scattered instead of all-reduced, and the last block's output is gathered again.
    The degree is the ``tensor`` size of ``parallel_mode`` (implied as ``tensor 2 x data rest``).
    """

    name = "tensor_parallel"
    contract = Contract(
        stage=Stage.TENSOR_PARALLEL,
        roles=("tensor_parallel", "model_parallel"),
        axis=TENSOR,
        conflicts=(ZERO1_CONFLICT,),
    )

    plan: Any = "auto"
    sequence_parallel: bool = False

    def __post_init__(self):
        object.__setattr__(self, "plan", normalize_plan(self.plan))
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError("tensor_parallel.sequence_parallel", self.sequence_parallel, "True or False")

    @classmethod
    def from_seed(cls, config=None):
        if config is None:
            return cls()
        if isinstance(config, TPInfo | str):
            return cls(plan=config)
        if isinstance(config, dict) and ("plan" in config or "sequence_parallel" in config):
            return cls(**config)
        return cls(plan=config)

    @classmethod
    def candidates(cls, search):
        """On paper only (``search.on_paper``): one ``tensor t x data d`` layout per degree t up to the
        devices of one node whose data size divides the global batch, so any data-parallel engine (fsdp
        over the data dimension: 2-D parallelism) composes with it. A trial search measures tensor
        degrees through mixed_parallel's own; its space is unchanged. Degrees above a node are not
        offered: every tensor-parallel all-reduce blocks the compute after it, and across nodes it
        would run at the network's speed, not the node's link."""
        from composable_atorch.core.context import NotOffered
        from composable_atorch.transforms.parallel.shared.options import layout_option

        env = search.env
        if not search.on_paper or env.world_size < 2:
            return ()
        per_node, out = env.processes_per_node, []
        for t in search.degrees:
            data = env.world_size // t
            if t > per_node:
                # the subject names the degrees: "tensor_parallel not proposed" would read as no degree at all
                why = f"every tensor-parallel all-reduce would leave the node's {per_node} devices for the network"
                out.append(NotOffered(f"tensor degrees above {per_node}", why))
            elif not search.batch_size % data:
                label = f"tensor {t} x data {data}: Linear layers sharded over {t} ranks of a node, data over {data}"
                out.append(layout_option("tensor", t, env.world_size, label, cls()))
        return tuple(out)

    def describe(self):
        how = "auto plan" if self.plan == "auto" else f"{len(self.plan)} manual entries"
        return f"tensor_parallel({how}{', sequence parallel' if self.sequence_parallel else ''})"

    # -- planning (pure: no sharding happens until everything checked) ---------------------
    def placements(
        self, model: nn.Module, degree: int
    ) -> tuple[dict[str, tuple[str, dict]], dict[str, tuple], dict[str, str]]:
        """``({module: (kind, kwargs)}, {module: shrink attrs}, {dropout module: kind})``; typed errors on bad input."""
        return self._placements(model, degree)[:3]

    def check(self, model: nn.Module, degree: int = 2) -> list[str]:
        """Plan and verify ``model`` at ``degree`` without touching its weights (the search calls this to
        rule a candidate out at no trial cost): TensorParallelPlanError when it cannot be sharded,
        else what explain() will say about the plan."""
        return self._placements(model, degree)[4]

    def _placements(self, model: nn.Module, degree: int) -> Placements:
        sp = self.sequence_parallel
        if self.plan != "auto":
            return resolve(model, degree, self.plan, [], sp)
        auto = plan_auto(model)
        try:
            return resolve(model, degree, auto.entries, [*auto.notes, *auto.source], sp)
        except TensorParallelPlanError as e:
            # a pair that fails at one rank's shapes (a norm over the whole q projection, a convolution or
            # ALiBi table built for the full width) stays whole, named; the other pairs shard
            return keep_failing_pairs(model, degree, auto, e, sp)

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        pc = parallel_context(state, self.name)
        degree = pc.layout.size("tensor")
        model = state.model
        placed = self._placements(model, degree)  # every check before any change
        for note in placed.notes:
            state.note(self.name, note)
        if not pc.distributed or degree == 1:
            state.note(
                self.name,
                f"tensor degree {degree}{'' if pc.distributed else ', no process group'}: model left whole "
                f"({len(placed.shard)} layers would shard)",
            )
            return state
        mesh = pc.mesh["tensor"]
        pc.applied.record(self.name, model)
        state.note(self.name, _from_first_rank(model, pc, mesh))
        reference, why = check.probe(model)  # the whole model's output, before any weight moves
        layers = _shard(model, placed, mesh, degree, self.sequence_parallel, state)
        state.note(self.name, _sharded_note(layers, placed.shrink, degree, self.sequence_parallel))
        state.note(
            self.name,
            "CPU RNG state synchronized over the tensor dim (replicated dropouts draw one process's "
            f"masks){drop_note(placed.drops)}",
        )
        if reference is None:
            state.note(self.name, why)
        else:
            state.note(self.name, check.compare(model, reference, mesh.get_group(), degree, suspects(layers)))
        return state


def _permute_strided(m: nn.Module, stride: int, degree: int) -> None:
    """A fused (strided) layer's rows (a Conv1D's columns) reordered so each rank's shard holds its part of every
    fused projection; the order is kept on the module (see :func:`full_weight`)."""
    with torch.no_grad():
        if is_conv1d(m):
            perm = stride_perm(m.weight.shape[1], stride, degree)
            m.weight.copy_(m.weight[:, perm])
        else:
            perm = stride_perm(m.weight.shape[0], stride, degree)
            m.weight.copy_(m.weight[perm])
        if m.bias is not None:
            m.bias.copy_(m.bias[perm])
    m._tp_stride_perm = perm  # global weights are stored in this order (see full_weight)


def _layer_styles(layers: dict, modules: dict, degree: int, sp: bool) -> dict[str, Any]:
    """torch's parallel style for each layer of the plan (fused layers permuted first)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    for n, (kind, kw) in layers.items():
        m = modules[n]
        if int(kw.get("stride", 1)) > 1:
            _permute_strided(m, int(kw["stride"]), degree)
        if kind == "vocab":
            styles[n] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif isinstance(m, nn.Embedding):  # a per-head table: each rank keeps its heads' columns
            styles[n] = ColwiseParallel()
        elif is_conv1d(m):
            styles[n] = conv1d_style(kind, sp)
        elif kind == "col" and kw.get("gather_output"):  # a head: its logits gathered, so any loss works
            styles[n] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif kind == "col":
            styles[n] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate())
        else:
            styles[n] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    return styles


def _sequence_styles(model, modules, layers, shard, styles, mesh, degree) -> dict[str, int]:
    """Sequence parallelism: the blocks' norms on their sequence shard, the residual stream split at the first
    block and gathered after the last; returns the sequence dims the dropout streams slice."""
    from torch.distributed.tensor.parallel import SequenceParallel

    blocks = blocks_of(model, list(layers))
    if not blocks:
        raise TensorParallelPlanError(
            "sequence parallelism needs the sharded layers inside a list of blocks (nn.ModuleList)", list(shard)
        )
    for n, m in modules.items():
        inside = any(n.startswith(b + ".") for b in blocks)
        if inside and (isinstance(m, nn.LayerNorm | nn.RMSNorm) or type(m).__name__.endswith("RMSNorm")):
            styles[n] = SequenceParallel(use_local_output=False)
    sequence: dict[str, int] = {}
    sequence_entry_exit(modules[blocks[0]], modules[blocks[-1]], mesh, degree, sequence)
    return sequence


def _shard(model: nn.Module, placed: Placements, mesh, degree: int, sp: bool, state: TrainState) -> dict:
    """Shard ``model`` as ``placed`` says (torch's ``parallelize_module``), then keep what sharding would lose:
    frozen flags, tied weights, per-head gradients summed, LoRA adapters, head counts, dropout streams."""
    from torch.distributed.tensor.parallel import parallelize_module

    who = TensorParallel.name
    modules = dict(model.named_modules())
    tied, trainable = tied_params(model), requires_grad(model)
    layers, adapters_whole, adapter_drops = lora.expand(placed.shard, modules)  # LoRA wrappers: their parts
    styles = _layer_styles(layers, modules, degree, sp)
    sequence = _sequence_styles(model, modules, layers, placed.shard, styles, mesh, degree) if sp else {}
    parallelize_module(model, mesh, styles)
    if refreeze(model, trainable):
        state.note(who, "frozen parameters (sequence-parallel norms) kept frozen after sharding")
    for n, (kind, _) in layers.items():
        if kind == "row" and not sp:
            modules[n].register_forward_hook(own_output)
    retie(model, tied, mesh, state)
    summed = list(placed.summed)
    if sp:  # an adapter kept whole runs on a sequence shard: its gradient is partial
        summed = [*summed, *adapters_whole]
        lora.local_inputs(model, placed.shard)
    sum_grads(model, summed, mesh, state)
    for d, kind in adapter_drops:
        if kind == "row":
            lora.feature_sliced(d, degree, mesh.get_local_rank())
        elif sp:
            sequence_sliced(d, degree, mesh.get_local_rank(), sequence)
    if adapters_whole:
        state.note(
            who,
            f"{len(adapters_whole)} LoRA adapter layer(s) kept whole beside their sharded base "
            "(A of a column layer, B of a row layer); the other adapter side shards with its base",
        )
    for n, attrs in placed.shrink.items():
        for a in attrs:
            setattr(modules[n], a, getattr(modules[n], a) // degree)
    dropout_streams(model, placed.drops, mesh, degree, sp, sequence)
    return layers


def _sharded_note(layers: dict, shrink: dict, degree: int, sp: bool) -> str:
    count = {k: sum(1 for kind, _ in layers.values() if kind == k) for k in ("col", "row", "vocab")}
    return (
        f"DTensor parallelize_module over the tensor dim of {degree}: {count['col']} colwise, {count['row']} "
        f"rowwise, {count['vocab']} vocab-parallel layer(s); {len(shrink)} attention module(s) shrunk to "
        f"heads/{degree}" + (", LayerNorms sequence-parallel" if sp else "")
    )


def _from_first_rank(model: nn.Module, pc, mesh) -> str:
    """Every rank takes its tensor (then data) group's first rank's parameters and buffers before the probe
    and the sharding, as ddp and fsdp do: ranks that built the model apart (no common seed) would each
    shard their own model, and the shards would assemble none of them."""
    why = check.without_values(model)
    if why:
        return f"weights not broadcast before sharding ({why})"
    broadcast_local(model, mesh.get_group())
    dims = "tensor"
    if pc.data_size > 1:
        broadcast_local(model, pc.data_group())
        dims = "tensor and data"
    return f"every rank starts from rank 0's weights (parameters and buffers broadcast over the {dims} dims)"


def suspects(layers: dict[str, tuple[str, dict]]) -> list[str]:
    """Column layers a wrong reading most likely comes from: fused (strided) ones first."""
    cols = [n for n, (k, _) in layers.items() if k == "col"]
    return sorted(cols, key=lambda n: int(dict(layers[n][1]).get("stride", 1)) == 1)


def full_weight(module: nn.Module, name: str = "weight", value: torch.Tensor | None = None) -> torch.Tensor:
    """The full (gathered) parameter in the model's original layout (undoing a stride permutation).

    ``value``: a tensor laid out like that parameter (its optimizer state) to gather instead.
    """
    from torch.distributed.tensor import DTensor

    p = getattr(module, name) if value is None else value
    full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    perm = getattr(module, "_tp_stride_perm", None)
    if perm is None:
        return full
    inv = torch.argsort(perm)
    if full.dim() == 1:
        return full[inv]
    return full[:, inv] if is_conv1d(module) else full[inv]


def tensor_parallel(plan: Any = "auto", *, sequence_parallel: bool = False) -> TensorParallel:
    """``tensor_parallel()`` (auto), ``tensor_parallel(TPInfo().shard_col(...)...)`` or a mapping."""
    return TensorParallel(plan=plan, sequence_parallel=sequence_parallel)

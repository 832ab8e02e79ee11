"""How sharded layers run: DTensor styles for HF's Conv1D, fused (strided) projections, the
sequence-parallel entry and exit of the block stack, and the fix-ups around ``parallelize_module``
(row outputs owned, per-head gradients summed, tied weights re-tied). Used by :mod:`.transform`.
"""

from __future__ import annotations

import types
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.tensor.dropout import per_rank, sequence_sliced, sync_rng
from composable_atorch.transforms.parallel.tensor.planner import TensorParallelPlanError


def stride_perm(n: int, stride: int, degree: int) -> torch.Tensor:
    """Order the ``n`` output features so that rank r's contiguous shard is [part0_r, part1_r, ...]."""
    part, chunk = n // stride, n // stride // degree
    return torch.tensor([s * part + r * chunk + i for r in range(degree) for s in range(stride) for i in range(chunk)])


def blocks_of(model: nn.Module, targets: list[str]) -> list[str]:
    """The ModuleList elements (transformer blocks) holding the sharded layers, in model order."""
    lists = {n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    found = set()
    for t in targets:
        parts = t.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[: i - 1]) in lists and i >= 2 and parts[i - 1].isdigit():
                found.add(".".join(parts[:i]))
                break
    return [n for n, _ in model.named_modules() if n in found]


def sequence_entry_exit(first: nn.Module, last: nn.Module, mesh, degree: int, sequence: dict) -> None:
    """Split the residual stream over the sequence entering ``first``; gather it leaving ``last``.

    ``sequence["length"]`` records the full length (sequence-sliced dropouts read it).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def enter(module, args, kwargs):
        if args:
            x, rest = args[0], args[1:]
        else:
            key = next(iter(kwargs))
            x = kwargs[key]
        if x.size(1) % degree:
            raise ConfigError(
                "sequence length (sequence_parallel)", x.size(1), f"a multiple of the tensor degree {degree}"
            )
        sequence["length"] = x.size(1)
        local = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()
        if args:
            return (local, *rest), kwargs
        return args, {**kwargs, key: local}

    def leave(module, args, output):
        def gather(t):
            return DTensor.from_local(t, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

        if isinstance(output, tuple):
            return (gather(output[0]), *output[1:])
        return gather(output)

    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave)


def conv1d_style(kind: str, sequence_parallel: bool = False):
    """Column/row parallel for HF's Conv1D (weight stored transposed: ``(in, out)``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = ColwiseParallel if kind == "col" else RowwiseParallel

    class Conv1DParallel(base):
        def _apply(self, module, device_mesh):
            from torch.distributed.tensor import distribute_module

            wdim, bias_pl = (1, Shard(0)) if kind == "col" else (0, Replicate())

            def partition(name, mod, mesh):
                mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(wdim)])))
                if mod.bias is not None:
                    mod.register_parameter("bias", nn.Parameter(distribute_tensor(mod.bias, mesh, [bias_pl])))

            if kind == "row":
                self.desired_input_layouts = (Shard(-1),)
            # Conv1D computes x @ W + b == linear(x, W.T, b): run it as that on the DTensors
            module.forward = types.MethodType(lambda self_, x: F.linear(x, self_.weight.t(), self_.bias), module)
            return distribute_module(
                module,
                device_mesh,
                partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    if not sequence_parallel:
        return Conv1DParallel()
    return Conv1DParallel(input_layouts=Shard(1)) if kind == "col" else Conv1DParallel(output_layouts=Shard(1))


def own_output(_module, _args, output):
    """A row-parallel output is a view DTensor's to_local made; a model that adds into it in place
    (Falcon's ``mlp_output += attention_output``) would hit autograd's view+inplace error: a copy."""
    return output.clone() if isinstance(output, torch.Tensor) else output


def sum_grads(model: nn.Module, names: list[str], mesh, state) -> None:
    """Replicated parameters that run on one rank's heads only (a per-head norm) get a partial gradient
    on each rank: the hooks sum it over the tensor ranks (transformers' replicated_with_grad_allreduce)."""
    if not names:
        return
    import torch.distributed as dist

    group = mesh.get_group()
    modules = dict(model.named_modules())
    count = 0
    for n in names:
        for p in modules[n].parameters(recurse=False):
            if p.requires_grad and not hasattr(p, "placements"):
                p.register_hook(lambda g, group=group: _summed(g, group, dist))
                count += 1
    state.note(
        "tensor_parallel",
        f"{count} replicated parameter(s) inside sharded attention: gradients summed over the tensor ranks",
    )


def _summed(grad, group, dist):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def dropout_streams(model: nn.Module, drops: dict[str, str], mesh, degree: int, sp: bool, sequence: dict) -> None:
    """Same stream on every tensor rank for replicated dropouts, one per rank for parallel ones (tp_dropout)."""
    sync_rng(mesh.get_group())
    rank = mesh.get_local_rank()
    modules = dict(model.named_modules())
    for n, kind in drops.items():
        if kind == "parallel_drop":
            per_rank(modules[n], modules.get(n.rpartition(".")[0]), rank)
        elif sp:
            sequence_sliced(modules[n], degree, rank, sequence)


def drop_note(drops: dict[str, str]) -> str:
    if not drops:
        return ""
    kinds = {k: sorted(n for n, v in drops.items() if v == k) for k in ("replic_drop", "parallel_drop")}
    return (
        "; "
        + "; ".join(f"{k}: {len(v)} module(s)" for k, v in kinds.items() if v)
        + " (parallel_drop on a per-rank stream)"
    )


def tied_params(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module, attribute) sharing one parameter (e.g. a tied lm_head / embedding)."""
    by_id: dict[int, list[tuple[str, str]]] = {}
    for mn, m in model.named_modules(remove_duplicate=False):
        for pn, p in m.named_parameters(recurse=False):
            by_id.setdefault(id(p), []).append((mn, pn))
    return [v for v in by_id.values() if len({x for x in v}) > 1]


def retie(model, tied, mesh, state) -> None:
    """Re-tie weights that sharding split apart: a tied Linear head shards like its embedding."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    modules = dict(model.named_modules(remove_duplicate=False))
    for group in tied:
        params = [getattr(modules[m], p) for m, p in group]
        dt = [x for x in params if isinstance(x, DTensor)]
        if not dt or len(dt) == len(params):
            continue
        src = dt[0]
        for (mn, pn), x in zip(group, params, strict=True):
            if isinstance(x, DTensor):
                continue
            mod = modules[mn]
            if isinstance(mod, nn.Linear) and pn == "weight" and src.placements[0].is_shard(0):
                parallelize_module(mod, mesh, ColwiseParallel(output_layouts=Replicate()))
                mod.weight = src
                state.note(
                    "tensor_parallel",
                    f"{mn}.weight stays tied to the vocab-parallel embedding: sharded colwise, logits gathered",
                )
            else:
                raise TensorParallelPlanError("tied parameters would be split apart by this plan", [f"{mn}.{pn}"])


def requires_grad(model: nn.Module) -> dict[str, bool]:
    """``requires_grad`` of every parameter by name, for :func:`refreeze`."""
    return {n: p.requires_grad for n, p in model.named_parameters()}


def refreeze(model: nn.Module, before: dict[str, bool]) -> int:
    """Restore ``requires_grad`` after ``parallelize_module``: torch's ``SequenceParallel`` style re-makes
    the norms' weights as new Parameters that require grad, so a frozen norm (a LoRA base model's)
    would start getting gradients. Returns how many were restored."""
    count = 0
    for n, p in model.named_parameters():
        if n in before and p.requires_grad != before[n]:
            p.requires_grad_(before[n])
            count += 1
    return count

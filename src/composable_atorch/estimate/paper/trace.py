"""The simulated step's ops in the order they ran, with what a GPU's overlap needs to know.

:class:`~composable_atorch.estimate.steptime.OpTrace` counts ops by kind and size; pricing a step
with the overlap a GPU has needs their order too, and for each collective the ranks of its group
and the mesh dimension it ran over (FSDP's all-gathers overlap compute, tensor-parallel all-reduces
block it). :class:`OrderedTrace` keeps OpTrace's counts (so everything that reads them still works)
and adds one :class:`Event` per counted op:

* compute: kind (mm / sdpa / sdpa_bwd / memory), dtype (a GEMM of a float8 Linear, forward or
  backward, is "float8": on this CPU torchao emulates it in bf16, on the GPU it is a float8 GEMM; its
  scales' amax reductions and casts are memory ops of their own), FLOPs or bytes, the bytes a GEMM moves (the
  roofline's memory side), whether autograd's backward ran it (a checkpoint's recompute is in the
  backward), an attention call's causal flag, key length and mask, and a memory op's tensors (for
  the compile fusion rule);
* collective: kind, bytes of the full tensor, the group's ranks and its mesh dimension (torch's
  DeviceMesh names its groups ``mesh_<dim>``);
* the optimizer step, as a barrier (a global optimizer pre-hook marks it): gradients' reductions
  must be done before it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from composable_atorch.estimate.steptime import COMM_KINDS, OpTrace


@dataclass(slots=True)
class Event:
    """One op of the step (see the module doc); ``kind`` "barrier" marks the optimizer step."""

    kind: str
    dtype: str = ""
    size: float = 0.0
    nbytes: float = 0.0
    backward: bool = False
    ranks: tuple[int, ...] = ()
    dim: str = ""
    causal: bool = False
    seq: int = 0
    mask: bool = False
    #: a memory op's tensors as ``(id, bytes)``: what it reads and what it writes
    reads: tuple[tuple[int, float], ...] = ()
    writes: tuple[tuple[int, float], ...] = ()

    @property
    def comm(self) -> bool:
        return self.kind in COMM_KINDS


class _Recording(Counter):
    """OpTrace's counter, remembering the key of the last count (the op just recorded)."""

    last = None

    def __setitem__(self, key, value):
        self.last = key
        super().__setitem__(key, value)


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _nbytes(ts) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def _group(args) -> dist.ProcessGroup | None:
    """The process group of a c10d op (a boxed ProcessGroup) or a functional collective (its name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue
        if isinstance(a, str):
            try:
                return _resolve_process_group(a)
            except (RuntimeError, ValueError, KeyError):
                continue
    return None


def dim_of(group: dist.ProcessGroup) -> str:
    """The mesh dimension a DeviceMesh group spans (``mesh_zero`` -> "zero", a flattened
    ``mesh_data_zero`` -> "data_zero"), "" for a group not made by a mesh."""
    desc = getattr(group, "group_desc", "") or ""
    return desc.removeprefix("mesh_") if desc.startswith("mesh_") else ""


def _arg(func, args, kwargs, name: str, default=None):
    """An op's argument by its schema name (positional or keyword)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else default
    return default


class OrderedTrace(OpTrace):
    """OpTrace plus the ordered :class:`Event` list (see the module doc)."""

    records_replays = False  # priced on declared hardware, never re-run on this CPU

    def __init__(self):
        super().__init__()
        self.ops = _Recording()
        self.events: list[Event] = []
        #: groups by mesh dimension that contain this rank (read when the trace closes)
        self.mesh_groups: dict[str, tuple[int, ...]] = {}
        self._hooks: list = []
        self._fake_on_entry = None
        self._fp8_depth = 0  # inside a float8 Linear's forward (torchao's Float8Linear)
        #: a serial number per tensor the events read or write, held weakly. Not ``id()``: a freed
        #: tensor's id is reused by a later one, which made fused runs share tensors they did not
        #: (the same plan priced up to 6% apart from run to run, by the allocator's reuse)
        self._serials = WeakIdKeyDictionary()
        self._next_serial = itertools.count()

    def __enter__(self):
        from torch._guards import active_fake_mode
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hooks = [
            register_optimizer_step_pre_hook(lambda *_: self.events.append(Event("barrier"))),
            register_module_forward_pre_hook(lambda m, *_: self._float8(m, 1)),
            register_module_forward_hook(lambda m, *_: self._float8(m, -1)),
        ]
        self._fake_on_entry = active_fake_mode()
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.mesh_groups = mesh_groups()
        return super().__exit__(*exc)

    def _float8(self, module, step: int) -> None:
        if type(module).__name__ in FLOAT8_LINEARS:
            self._fp8_depth += step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        # as torch's MemTracker: an op on DTensors carries the global shapes; NotImplemented lets
        # DTensor run it as the local ops (and redistributions) a device really runs, which come
        # back here; the ops of DTensor's sharding propagation (under its own fake mode) are skipped
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        if active_fake_mode() is not self._fake_on_entry:
            return func(*args, **(kwargs or {}))
        self.ops.last = None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        key = self.ops.last
        if key is not None:
            try:
                self.events.append(self.event(func, args, kwargs or {}, out, key))
            except Exception:  # noqa: BLE001 - an op the event cannot describe keeps its count, as memory traffic
                self.events.append(Event("memory", key[1], key[2], backward=_in_backward()))
        return out

    def event(self, func, args, kwargs, out, key) -> Event:
        kind, dtype, size = key
        backward = _in_backward()
        if kind in COMM_KINDS:
            group = _group(args)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            return Event(kind, "", size, backward=backward, ranks=ranks, dim=dim_of(group) if group else "")
        ins = _tensors((args, kwargs))
        if kind == "mm":
            dtype = "float8" if self._fp8_depth > 0 or _float8_backward() else _dtype(ins, dtype)
            return Event(kind, dtype, size, _nbytes(ins + _tensors(out)), backward)
        if kind in ("sdpa", "sdpa_bwd"):
            key_t, query = _arg(func, args, kwargs, "key"), _arg(func, args, kwargs, "query")
            causal = bool(_arg(func, args, kwargs, "is_causal", False))
            mask = _arg(func, args, kwargs, "attn_mask")
            seq = int(key_t.shape[-2]) if isinstance(key_t, torch.Tensor) and key_t.dim() >= 2 else 0
            if _square(mask, query, seq):
                causal, mask = True, None
            mask = isinstance(mask, torch.Tensor)
            return Event(kind, dtype, size, _nbytes(ins + _tensors(out)), backward, causal=causal, seq=seq, mask=mask)
        outs = _tensors(out)
        return Event(
            kind,
            dtype,
            size,
            backward=backward,
            reads=tuple((self._serial(t), _nbytes([t])) for t in ins),
            writes=tuple((self._serial(t), _nbytes([t])) for t in outs),
        )

    def _serial(self, t) -> int:
        serial = self._serials.get(t)
        if serial is None:
            serial = self._serials[t] = next(self._next_serial)
        return serial


def _square(mask, query, seq: int) -> bool:
    """A mask over the whole ``[s, s]`` square of a self-attention call, taken for the causal mask:
    transformers builds one when it cannot read the position ids' values to see that sequences are
    not packed (fake tensors have no values; on the GPU it passes ``is_causal`` and no mask), and
    older transformers always built one (the flash kernels ATorch's ``module_replace`` swapped in
    ran causal without it). So such a call is priced as causal flash attention; a mask of another
    shape (padding, cross-attention) stays a mask (the memory-efficient kernel)."""
    return (
        isinstance(mask, torch.Tensor)
        and isinstance(query, torch.Tensor)
        and mask.dim() >= 2
        and mask.shape[-1] == mask.shape[-2] == seq == query.shape[-2]
    )


#: modules whose GEMMs run in float8 (torchao), and the autograd functions of their backward
FLOAT8_LINEARS = ("Float8Linear",)
FLOAT8_BACKWARD = ("matmul_with_hp_or_float8_args",)


def _float8_backward() -> bool:
    """Whether autograd is running a float8 Linear's backward (torchao's matmul function): its GEMMs
    are float8 GEMMs on a GPU with float8 units, whatever the emulation on this CPU computes in."""
    node = torch._C._current_autograd_node()
    return node is not None and any(n in node.name() for n in FLOAT8_BACKWARD)


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _dtype(ins: list[torch.Tensor], counted: str) -> str:
    """A GEMM's input dtype, float8 variants as "float8" (``_scaled_mm``'s operands)."""
    if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in ins):
        return "float8"
    return counted


def mesh_groups() -> dict[str, tuple[int, ...]]:
    """This rank's DeviceMesh groups by dimension name, read from the live process groups (the
    data group of a DDP step, which the fake world never runs, is priced over it)."""
    if not dist.is_initialized():
        return {}
    me = dist.get_rank()
    out: dict[str, tuple[int, ...]] = {}
    try:
        from torch.distributed.distributed_c10d import _world

        tables = list(_world.pg_group_ranks.items())
    except (ImportError, AttributeError):
        return out
    for group, table in tables:
        name = dim_of(group)
        if name and me in table:
            out[name] = tuple(sorted(table))
    return out

"""Cutting one pipeline stage out of a model read by :mod:`.anatomy` (in place), and keeping the
tied weights that the first and the last stage both hold equal.

The stage is the model itself: its block list keeps this stage's blocks, the pieces other stages
hold are parameter-free stand-ins, hooks put the received activation in front of its first block
and stop its forward after its last one (the module doc of :mod:`.anatomy` says why).
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist
from torch import nn

from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.transforms.parallel.pipeline.anatomy import Anatomy, hidden_name, hidden_of


class _Stop(Exception):
    """Raised by a hook to end a probe or a non-last stage's forward at a block; carries its output."""

    def __init__(self, hidden):
        super().__init__("stage output")
        self.hidden = hidden


class Skipped(nn.Module):
    """Stands in for a piece another stage holds, with no parameters. Whatever it returns the
    stage's first block never sees (its input is put back to the received activation), but the code
    around the blocks may build things from its shape (DeBERTa's relative positions are built for
    the embeddings' output length), so it returns what that code would get on the whole model: a
    further embedding (positions, added to the tokens') gives a zero; anything else (the token
    embedding, an embedding norm, a projection) gives the activation the stage received, which has
    the shape of the embeddings' output. Not the first floating-point input it is called with: that
    may be another input (the float attention mask a model builds itself when given none).
    ``received`` holds the stage's received activation while it runs (see :func:`cut_stage`); a
    stand-in without one (an after-piece, never reached) passes its first floating-point input on."""

    def __init__(self, zero: bool = False):
        super().__init__()
        self.zero = zero
        self.received: list | None = None

    def forward(self, *args, **kwargs):
        if self.zero:
            return torch.zeros(())
        if self.received is not None and self.received[0] is not None:
            return self.received[0]
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return a
        return torch.zeros(())


def ghost(piece: nn.Module, zero: bool = False) -> nn.Module:
    """A :class:`Skipped` with ``piece``'s submodules and the shapes and dtypes of its weights as
    meta tensors (plain attributes: no parameters, no state, never moved): a forward that reads
    ``self.embeddings.patch_embeddings.projection.weight.dtype`` before calling the piece (ViT)
    still runs on a stage that does not hold it."""
    stand_in = Skipped(zero)

    def copy_into(src: nn.Module, dst: nn.Module) -> None:
        for name, t in (*src._parameters.items(), *src._buffers.items()):
            if t is not None:
                dst.__dict__[name] = torch.empty_like(t, device="meta")
        for name, child in src._modules.items():
            if child is not None:
                sub = nn.Module()
                copy_into(child, sub)
                dst._modules[name] = sub

    copy_into(piece, stand_in)
    return stand_in


class Absent(nn.Module):
    """Stands in, with no parameters, for a block another stage holds. The block list keeps its
    length, so a model whose forward reads a per-layer setting by the layer's position in the loop
    (``for i, layer in enumerate(self.layers)`` with ``config.layer_types[i]``: Gemma 2/3, GPT-OSS,
    Cohere 2, Qwen2 with sliding layers) gives each block this stage holds its own setting, not the
    setting of the block at its position within the stage. Blocks before the stage's first pass
    their input on (the first held block's input is put back to the received activation anyway);
    blocks after its last are never reached (the forward stops there)."""

    def __init__(self, hidden: str, returns: int = 0):
        super().__init__()
        self.hidden, self.returns = hidden, returns

    def forward(self, *args, **kwargs):
        h = args[0] if args else kwargs.get(self.hidden)
        return (h, *[None] * (self.returns - 1)) if self.returns else h


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def hold(model: nn.Module, an: Anatomy, first: bool, last: bool, kept, received: list | None = None) -> list[nn.Module]:
    """Keep blocks ``kept`` (and the first / last stage's pieces when ``first`` / ``last``) in
    ``model``, in place; stand-ins for the rest (those of the before-pieces return the activation in
    ``received``). Returns the model's blocks as they were."""
    listed = model.get_submodule(an.path) if an.path else model
    blocks = list(listed._modules.values())  # this model's own (a copy's, for one of several stages per rank)
    keep = {str(i) for i in kept}
    for i, key in enumerate(list(listed._modules)):
        if key not in keep:  # the list keeps its length: a layer's index in the loop is its global index
            listed._modules[key] = Absent(hidden_name(blocks[i]), an.block_returns)
    if not first:
        for i, p in enumerate(an.pre):
            piece = model.get_submodule(p)
            if p not in an.shared:
                stand_in = ghost(piece, zero=i > 0 and isinstance(piece, nn.Embedding))
                stand_in.received = received
                _replace(model, p, stand_in)
    if not last:
        for p in an.post:
            if p not in an.shared:
                _replace(model, p, ghost(model.get_submodule(p)))
    return blocks


def share(model: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer with ``model`` (new module
    objects, hooks and submodule dicts of their own): one of several stages a rank holds is cut from
    it, in place, while the optimizer steps the one set of parameters all of them use."""
    import types

    memo: dict[int, nn.Module] = {}

    def clone(m: nn.Module) -> nn.Module:
        if id(m) in memo:  # a module registered twice stays one module
            return memo[id(m)]
        c = copy.copy(m)
        memo[id(m)] = c
        for k, v in vars(m).items():
            if isinstance(v, dict) and ("hooks" in k or k in ("_parameters", "_buffers")):
                c.__dict__[k] = type(v)(v)
            elif isinstance(v, types.MethodType) and v.__self__ is m:
                c.__dict__[k] = types.MethodType(v.__func__, c)
        c._modules = {k: None if v is None else clone(v) for k, v in m._modules.items()}
        return c

    return clone(model)


def cut_stage(model: nn.Module, an: Anatomy, first: bool, last: bool, kept: range, guard) -> nn.Module:
    """The model cut to one stage in place (see the module doc); ``guard(model)`` runs first in its forward."""
    import types

    box: list = [None]
    blocks = hold(model, an, first, last, kept, box)
    if not first:

        def put_back(module, args, kwargs):
            if box[0] is None:  # a checkpoint's recompute in the backward: its saved inputs are already the stage's
                return None
            if args:
                return (box[0], *args[1:]), kwargs
            return args, {**kwargs, hidden_name(module): box[0]}

        blocks[kept.start].register_forward_pre_hook(put_back, with_kwargs=True)
    if not last:

        def stop(module, args, out):
            raise _Stop(hidden_of(out))

        blocks[kept.stop - 1].register_forward_hook(stop)
    whole = model.forward
    extra = _extra(model)
    names = inputs_of(model, an)

    def forward(self, x, *carried):
        guard(self)
        box[0] = _Dense.apply(x) if x.requires_grad else x
        more = dict(zip(an.carry, carried, strict=True))
        try:
            if an.hf:
                out = whole(**{names[0] if first else names[1]: x}, **more, **extra)
            else:
                out = whole(x, *carried)
        except _Stop as stopped:
            hidden = stopped.hidden.contiguous()  # sent as is: gloo / NCCL send and receive dense buffers
            return (hidden, *carried) if carried else hidden
        finally:
            box[0] = None
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, tuple | list) else out

    model.forward = types.MethodType(forward, model)
    return model


class _Dense(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: the gradient a stage sends back for its input
    (received into a buffer laid out like it) must be contiguous for gloo / NCCL (ConvNeXt's permutes)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _extra(model: nn.Module) -> dict:
    """No key/value cache: a stage trains, it does not generate."""
    return {"use_cache": False} if "use_cache" in takes(model) else {}


def takes(model: nn.Module) -> list[str]:
    """The forward's named inputs (a PEFT wrapper's: its base model's, which it passes on)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inspect.signature(base.forward).parameters)


def inputs_of(model: nn.Module, an: Anatomy) -> tuple[str, str]:
    """(the input the first stage is called with, the one a later stage gives the received activation
    as): ``input_ids`` / ``pixel_values`` (the model's ``main_input_name``), then ``inputs_embeds``
    where the forward takes it, else the main input again (the embeddings, a stand-in there, pass it on)."""
    main = getattr(model, "main_input_name", "input_ids") if an.hf else ""
    return main, "inputs_embeds" if "inputs_embeds" in takes(model) else main


def call_whole(model: nn.Module, an: Anatomy, x, **carried):
    """The whole model's forward on ``x`` as its first stage calls it (the per-layer check's reference)."""
    if not an.hf:
        return model(x, *carried.values())
    return model(**{inputs_of(model, an)[0]: x}, **carried, **_extra(model))


class TiedGradSync(OptimizerHook):
    """Add the gradients of weights the first and the last stage both hold (tied embeddings).

    One process sums the two uses' gradients in one tensor; here each stage holds a copy and sees
    its own use only, so the two exchange gradients (point to point, only the two ranks take part)
    and step the same sum: the copies stay equal, as DeepSpeed's tied layers do.
    """

    def __init__(self, params: list[nn.Parameter], peer: int, group):
        self.params, self.peer, self.group = params, peer, group

    def before_step(self, optimizer):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            theirs = torch.empty_like(p.grad)
            ops = [
                dist.P2POp(dist.isend, p.grad, group=self.group, group_peer=self.peer),
                dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=self.peer),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            p.grad.add_(theirs)


class SharedGradSync(OptimizerHook):
    """Sum over the pipeline the gradients of pieces every stage holds (:attr:`Anatomy.shared`): one
    process sums every layer's use in one tensor; here each stage sees its own layers' uses."""

    def __init__(self, params: list[nn.Parameter], group):
        self.params, self.group = params, group

    def before_step(self, optimizer):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)


def shared_sync(an, kept: nn.Module, group):
    """The hook that sums the shared pieces' gradients over the pipeline; None when there are none."""
    if an is None or not an.shared:
        return None
    params = [w for p in an.shared for w in kept.get_submodule(p).parameters() if w.requires_grad]
    return SharedGradSync(params, group) if params else None


def tied_sync(an, kept: nn.Module, local: list[int], n_stages: int, placement: dict, group):
    """The hook that keeps tied copies equal on the first and last stage's ranks; None when not needed."""
    if an is None or not an.tied or (0 in local and n_stages - 1 in local):
        return None
    if 0 in local:
        names, peer = [a for a, _ in an.tied], placement[n_stages - 1]
    elif n_stages - 1 in local:
        names, peer = [b for _, b in an.tied], placement[0]
    else:
        return None
    return TiedGradSync([kept.get_parameter(n) for n in names], peer, group)

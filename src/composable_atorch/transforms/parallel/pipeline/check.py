"""The per-layer check: does each stage run its blocks exactly as the whole model runs them?

A stage is the user's model cut in place and its own forward runs on every stage, so whatever the
forward computes for each block (attention masks, sliding or full by the layer's type, position
ids / rotary embeddings, relative-position tables, per-layer scales) is recomputed on each stage.
That is only right if the forward computes the same thing for a block whether it runs in the
whole model or in a stage: a forward that chose a layer's mask by the layer's position within the
stage trained Gemma 2 and GPT-OSS silently wrong. So before training, on a probe sequence longer
than the model's attention windows, the whole model's forward is recorded (each block's inputs
besides the hidden states, and its output) and each stage this rank holds is run on the same
probe: a block whose inputs or output differ from the whole model's is refused with
:class:`StageMismatchError` naming the block and the input, rather than trained wrongly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from composable_atorch.errors import CompositionError
from composable_atorch.transforms.parallel.pipeline.anatomy import (
    Anatomy,
    UncuttableModelError,
    hidden_name,
    hidden_of,
    probe_input,
)
from composable_atorch.transforms.parallel.pipeline.cutter import takes

#: the probe is at least this long, and longer than any attention window the config names (up to MAX_PROBE)
MIN_PROBE, MAX_PROBE = 16, 512


class StageMismatchError(UncuttableModelError):
    """A stage would run a block on other inputs than the whole model gives it (a silent wrong result)."""


@dataclass
class Reference:
    """The whole model's probe: its input and each block's other inputs, hidden input and output."""

    example: torch.Tensor
    #: the padded attention mask the probe carries from stage to stage (None: the model takes none)
    mask: torch.Tensor | None = None
    #: the model's output (its logits): what the last stage must return
    final: torch.Tensor | None = None
    inputs: dict[int, tuple] = field(default_factory=dict)  #: block -> (args after the hidden, kwargs less it)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  #: block -> hidden input
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  #: block -> hidden output


def probe_length(model: nn.Module) -> int:
    """Longer than every attention window the config names (so a sliding mask differs from a full one)."""
    config = getattr(model, "config", None)
    windows = [
        v
        for k, v in (vars(config).items() if config is not None else ())
        if "window" in k and isinstance(v, int) and not isinstance(v, bool) and v > 0
    ]
    n = max([MIN_PROBE, *(w + 2 for w in windows)])
    longest = getattr(config, "max_position_embeddings", None)
    if isinstance(longest, int) and longest > 1:
        n = min(n, longest)
    return min(n, MAX_PROBE)


@contextlib.contextmanager
def _evaluating(model: nn.Module, grad: bool = False):
    """Dropout off and the RNG untouched for the probe; each module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.set_grad_enabled(grad), torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _record(blocks: dict[int, nn.Module], into: Reference):
    """Hooks that record each block's call (the hidden input apart) and output; run first."""
    handles = []
    for i, b in blocks.items():
        name = hidden_name(b)

        def pre(m, args, kwargs, i=i, name=name):
            if args:
                into.hidden[i], into.inputs[i] = args[0], (args[1:], dict(kwargs))
            else:
                into.hidden[i] = kwargs.get(name)
                into.inputs[i] = ((), {k: v for k, v in kwargs.items() if k != name})

        def post(m, args, out, i=i):
            into.outputs[i] = hidden_of(out)

        handles.append(b.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(b.register_forward_hook(post, prepend=True))  # before a stage's stop hook
    return handles


def reference(model: nn.Module, an: Anatomy, call) -> Reference | None:
    """The whole model's probe forward (``call(model, example)`` runs it); None when it cannot run
    (weights not real, input unknown). Sets ``an.block_returns`` from what the blocks return."""
    params = list(model.parameters())
    if not params or any(p.is_meta or hasattr(p, "to_local") for p in params):
        return None
    example = probe_input(model, an, probe_length(model))
    if example is None:
        return None
    mask = None
    if an.hf and example.dim() == 2 and "attention_mask" in takes(model):  # the last quarter padded
        mask = (torch.arange(example.shape[1], device=example.device) < example.shape[1] * 3 // 4).long()[None]
    returns: list = []
    for tried in (mask,) if mask is None else (mask, None):  # a model the padded probe fails: none
        ref = Reference(example, tried)
        returns.clear()
        handles = _record(dict(enumerate(an.blocks)), ref)
        handles.append(an.blocks[0].register_forward_hook(lambda m, a, out: returns.append(out)))
        try:
            with _evaluating(model, grad=True):  # side inputs keep their graph: which pieces feed them (below)
                out = call(model, example, **({} if tried is None else {"attention_mask": tried}))
            ref.final = _output(out)
            an.shared = _feeding(model, an, ref)
            break
        except CompositionError:
            raise
        except Exception:  # noqa: BLE001 - retried without the mask; failing without it: not checked (explain)
            if tried is None:
                return None
        finally:
            for h in handles:
                h.remove()
    if returns and isinstance(returns[0], tuple | list):
        an.block_returns = len(returns[0])
    return ref


def _output(out):
    """The tensor a model's forward gives (its logits), as a stage returns it."""
    if hasattr(out, "logits"):
        out = out.logits
    out = out[0] if isinstance(out, tuple | list) else out
    return out.detach() if isinstance(out, torch.Tensor) else None


def _close(a, b) -> bool:
    if a.device.type == "meta" or b.device.type == "meta" or a.shape != b.shape:
        return False
    a, b = _local(a).float().cpu(), _local(b).float().cpu()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return torch.allclose(a, b, rtol=1e-3, atol=1e-4 * max(scale, 1.0))


def _feeding(model: nn.Module, an: Anatomy, ref: Reference) -> list[str]:
    """The pieces whose weights reach the blocks besides through the hidden states (DeBERTa's relative
    position table and its norm, given to every layer): every stage must hold them."""
    side = [
        t
        for args, kwargs in ref.inputs.values()
        for t in (
            *args,
            *kwargs.values(),
            *(v for a in (*args, *kwargs.values()) if isinstance(a, tuple | list) for v in a),
        )
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    out = []
    if side:
        total = sum(t.float().sum() for t in side)
        for p in (*an.pre, *an.post):
            params = [w for w in model.get_submodule(p).parameters() if w.requires_grad]
            grads = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True) if params else ()
            if any(g is not None for g in grads):
                out.append(p)
    for i in ref.inputs:  # the graph is no longer needed: the reference keeps plain tensors
        ref.inputs[i] = _detached(ref.inputs[i])
        ref.hidden[i] = _detached(ref.hidden[i])
        ref.outputs[i] = _detached(ref.outputs[i])
    return out


def _detached(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple | list):
        return type(v)(_detached(x) for x in v)
    if isinstance(v, dict):
        return {k: _detached(x) for k, x in v.items()}
    return v


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _differs(a, b, where: str) -> str | None:
    """Where ``a`` (the stage's) and ``b`` (the whole model's) differ, or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where} is {_kind(a)} on the stage, {_kind(b)} in the whole model"
        a, b = _local(a), _local(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{where} is {_kind(a)} on the stage, {_kind(b)} in the whole model"
        same = torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a.cpu(), b.cpu(), 1e-5, 1e-6)
        return None if same else f"{where} has other values on the stage than in the whole model"
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        if len(a) != len(b):
            return f"{where} has {len(a)} items on the stage, {len(b)} in the whole model"
        return next((d for k, (x, y) in enumerate(zip(a, b)) if (d := _differs(x, y, f"{where}[{k}]"))), None)
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where} has keys {sorted(a)} on the stage, {sorted(b)} in the whole model"
        return next((d for k in a if (d := _differs(a[k], b[k], f"{where}[{k!r}]"))), None)
    if isinstance(a, int | float | str | bool | type(None)) or isinstance(b, int | float | str | bool | type(None)):
        return None if a == b else f"{where} is {a!r} on the stage, {b!r} in the whole model"
    return None if type(a) is type(b) else f"{where} is a {type(a).__name__} on the stage, a {type(b).__name__}"


def _kind(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')} tensor"
    return repr(v) if v is None else f"a {type(v).__name__}"


def check_stage(
    stage: nn.Module,
    number: int,
    blocks: dict[int, nn.Module],
    first: bool,
    ref: Reference,
    carry=None,
    last: bool = False,
) -> None:
    """Run ``stage`` (holding ``blocks``, index -> block) on the probe, the padded mask handed on as the
    stages hand it (named in ``carry``, the anatomy's list); StageMismatchError where a block sees
    other inputs or gives another output than in the whole model."""
    start = min(blocks)
    got = Reference(ref.example)
    handles = _record(blocks, got)
    carried = () if ref.mask is None or carry is None else (ref.mask,)
    if carried:
        carry[:] = ["attention_mask"]
    try:
        with _evaluating(stage):
            returned = _output(stage(ref.example if first else ref.hidden[start], *carried))
    except CompositionError:
        raise
    except Exception as exc:  # noqa: BLE001 - the whole model ran this probe: the cut broke it
        raise StageMismatchError(
            type(stage).__name__,
            f"stage {number} fails on a probe the whole model runs ({type(exc).__name__}: {str(exc)[:200]}): "
            "its forward needs a piece or input another stage holds",
            "train this model with ddp / fsdp / zero2 / tensor_parallel, or pass split=[...] so that the "
            "pieces it needs stay with it",
        ) from exc
    finally:
        for h in handles:
            h.remove()
        if carry is not None:
            carry[:] = []
    if last and ref.final is not None and (returned is None or not _close(returned, ref.final)):
        raise StageMismatchError(
            type(stage).__name__,
            f"the last stage (stage {number}) returns another output than the whole model on the same probe "
            f"({_kind(returned)}, not {_kind(ref.final)}): its forward after the blocks needs something another "
            "stage holds (a weight used outside its module, e.g. the embedding's reused by a functional head)",
            "hold the reused weight in a module of its own (an nn.Linear head tied to the embedding), or train "
            "this model with ddp / fsdp / zero2 / tensor_parallel",
        )
    for i in sorted(blocks):
        if i not in got.inputs:
            problem = "it is not run on the stage"
        else:
            args, kwargs = got.inputs[i]
            want_args, want_kwargs = ref.inputs[i]
            problem = _differs(args, want_args, "its positional input") or _differs(kwargs, want_kwargs, "its input")
            if problem is None and i not in got.outputs:
                problem = "it returns nothing on the stage"
            if problem is None:
                if not _close(got.outputs[i], ref.outputs[i]):
                    problem = (
                        "its output differs from the whole model's on the same inputs (a setting the forward "
                        "chooses by the block's position?)"
                    )
        if problem is not None:
            raise StageMismatchError(
                type(stage).__name__,
                f"on a probe of {tuple(ref.example.shape)}{' padded' if carried else ''}, "
                f"stage {number}'s block {i}: {problem}, so the stage "
                "would train it wrongly (its forward computes something for the block that depends on which blocks "
                "the stage holds)",
                "train this model with ddp / fsdp / zero2 / tensor_parallel, or report the model: the check "
                "refused it rather than train it silently wrong",
            )

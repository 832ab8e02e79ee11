"""The per-layer check: does each stage run its blocks exactly as the whole model runs them?

A stage is the user's model cut in place and its own forward runs on every stage, so whatever the
forward computes for each block (attention masks, sliding or full by the layer's type, position
ids / rotary embeddings, relative-position tables, per-layer scales) is recomputed on each stage.
That is only right if the forward computes the same thing for a block whether it runs in the
whole model or in a stage: a forward that chose a layer's mask by the layer's position within the
stage trained Gemma 2 and GPT-OSS silently wrong. So before training the whole model's forward is
recorded on probes (each block's inputs besides the hidden states, and its output) and each stage
this rank holds is run on the same probes: a block whose inputs or output differ from the whole
model's, or a stage that raises where the whole model runs, is refused with
:class:`StageMismatchError` naming the stage and the block, rather than trained wrongly or left to
crash in training.

The probes are shaped as training will feed the stages: two rows (a table built for the wrong
dimension does not broadcast silently over one), the loader's sequence length where its dataset
tells it (else longer than every attention window the config names), and, for an HF model taking
an attention mask, each form the runner accepts: a padded batch dict, its mask carried from stage
to stage, and a plain tensor, the model building its own mask (DeBERTa builds a float one, which a
stage once took for its embeddings' output).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
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

#: without a loader's length the probe is at least MIN_PROBE long, and longer than any attention window the
#: config names; never over MAX_PROBE
MIN_PROBE, MAX_PROBE = 16, 512
#: rows of the probe: more than one, so that a table a stage builds for another dimension than the
#: batch's does not broadcast over a single row
PROBE_ROWS = 2


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


def probe_length(model: nn.Module, length: int | None = None) -> int:
    """The loader's sequence ``length`` when known (what training runs), else longer than every
    attention window the config names (so a sliding mask differs from a full one); at most MAX_PROBE."""
    if length is not None and length > 0:
        return min(length, MAX_PROBE)
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


def reference(model: nn.Module, an: Anatomy, call, padded: bool = True, length: int | None = None) -> Reference | None:
    """The whole model's forward (``call(model, example, **carried)`` runs it) on a probe of PROBE_ROWS
    rows, its last row's last quarter padded when ``padded`` and the (HF) model takes an attention mask
    (unpadded where the padded probe fails); None when it cannot run (weights not real, input unknown).
    Sets ``an.shared`` and ``an.block_returns`` from what it sees."""
    params = list(model.parameters())
    if not params or any(p.is_meta or hasattr(p, "to_local") for p in params) or estimating(model):
        return None
    example = probe_input(model, an, probe_length(model, length), rows=PROBE_ROWS)
    if example is None:
        return None
    mask = None
    if padded and an.hf and example.dim() == 2 and "attention_mask" in takes(model):
        n = example.shape[1]
        mask = torch.ones_like(example)
        mask[-1] = (torch.arange(n, device=example.device) < n * 3 // 4).long()
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
            fed = _feeding(model, an, ref)
            an.shared = [p for p in (*an.pre, *an.post) if p in an.shared or p in fed]
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


def estimating(model: nn.Module) -> bool:
    """Whether the model is on fake tensors (``estimate`` applies the plan there): no values to
    compare, and a comparison of fake values cannot be computed (``allclose`` needs data)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    return detect_fake_mode() is not None or any(isinstance(p, FakeTensor) for p in model.parameters())


def references(model: nn.Module, an: Anatomy, call, length: int | None = None) -> list[Reference]:
    """The whole model's probe in each form training may feed it: padded, its mask carried (where the
    model takes one), and a plain tensor; empty when none can run. A stage is checked on each."""
    first = reference(model, an, call, padded=True, length=length)
    if first is None:
        return []
    if first.mask is None:
        return [first]
    plain = reference(model, an, call, padded=False, length=length)
    return [first] if plain is None else [first, plain]


def describe(refs: list[Reference]) -> str:
    """The probes as the explain line names them: ``(2, 16): padded (its attention mask carried) and unpadded``."""
    forms = " and ".join("padded (its attention mask carried)" if r.mask is not None else "unpadded" for r in refs)
    return f"{tuple(refs[0].example.shape)}: {forms}"


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
    probe = f"a probe of {tuple(ref.example.shape)}{' padded' if carried else ''}"
    try:
        with _evaluating(stage):
            returned = _output(stage(ref.example if first else ref.hidden[start], *carried))
    except CompositionError:
        raise
    except Exception as exc:  # noqa: BLE001 - the whole model ran this probe: the cut broke it
        raise StageMismatchError(
            type(stage).__name__,
            f"stage {number} fails {_failed_at(blocks, got)} on {probe} the whole model runs "
            f"({type(exc).__name__}: {str(exc)[:300]}), so it would crash in training: its forward builds "
            "something for the blocks from a piece or an input another stage holds",
            "train this model with ddp / fsdp / zero2 / tensor_parallel, or pass split=[...] so that the "
            "pieces it needs stay with it, or report the model: the check refused it before any step",
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
                f"on {probe}, stage {number}'s block {i}: {problem}, so the stage "
                "would train it wrongly (its forward computes something for the block that depends on which blocks "
                "the stage holds)",
                "train this model with ddp / fsdp / zero2 / tensor_parallel, or report the model: the check "
                "refused it rather than train it silently wrong",
            )


def _failed_at(blocks: dict[int, nn.Module], got: Reference) -> str:
    """Where a stage's forward raised: in the held block it entered and did not leave, else before its
    first block or after its last (in the code around them: embeddings, masks, positions, the head)."""
    open_ = [i for i in sorted(blocks) if i in got.hidden and i not in got.outputs]
    if open_:
        return f"in block {open_[0]} ({type(blocks[open_[0]]).__name__})"
    if not got.hidden:
        return f"before its first block {min(blocks)} (in the forward around the blocks)"
    return f"after its last block {max(blocks)} (in the forward around the blocks)"


def check_stages(an: Anatomy | None, stage_mods: list[nn.Module], local: list[int], bounds, group=None) -> str:
    """Each of this rank's stages run on each of the whole model's probes, block by block
    (:func:`check_stage`); the explain line. With the pipeline's ``group`` the ranks agree: a stage
    refused on one rank is refused on every rank (the others would wait on it in the first step)."""
    if an is None:
        return ""
    if not an.references:
        if any(estimating(m) for m in stage_mods):
            return "per-layer inputs not checked against the whole model (fake tensors: the plan is being estimated)"
        return "per-layer inputs not checked against the whole model (its probe forward could not run)"
    error: StageMismatchError | None = None
    try:
        for ref in an.references:
            for s, stage in zip(local, stage_mods, strict=True):
                listed = stage.get_submodule(an.path) if an.path else stage
                held = {i: listed[i] for i in range(bounds[s], bounds[s + 1])}
                check_stage(stage, s, held, s == 0, ref, an.carry, last=s == len(bounds) - 2)
    except StageMismatchError as exc:
        error = exc
    if group is not None:
        said: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, None if error is None else (error.model, error.reason, error.fix), group=group)
        if error is None and any(said):
            error = StageMismatchError(*next(x for x in said if x))
    if error is not None:
        raise error
    return (
        f"each stage's blocks see the whole model's inputs and give its outputs on probes of "
        f"{describe(an.references)} (checked before training)"
    )

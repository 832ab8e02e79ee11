"""Reading a model for the pipeline cut: its block list and which pieces run before / after it.

A stage is the user's model itself, cut in place, so its forward (masks, rotary or absolute
positions, ALiBi, scalings: whatever the family computes around its blocks) still runs on every
stage and parameter names are unchanged:

* the block list keeps its length: this stage's blocks, parameter-free stand-ins for the others
  (a forward that picks a layer's setting by its index in the loop, ``config.layer_types[i]``,
  gets each block's own), original indices as keys;
* the *pieces* (modules with parameters outside the blocks) are told apart into those that run
  before the blocks (embeddings) and after them (final norm, head): from transformers'
  ``base_model_pp_plan`` where the family ships one, else from the order in which a one-sequence
  probe forward calls them, else (weights on the meta device) from their registration order;
* a stage without the first block has its *before* pieces replaced by parameter-free stand-ins and
  is called with the received activation (as ``inputs_embeds`` for an HF model that takes it, else
  as its main input: ViT's ``pixel_values``); a pre-hook on its first block puts the activation
  back in place of whatever the embedding code made of it (GPT-2's ``wpe``, Granite's multiplier,
  BLOOM's embedding norm), so that code needs no per-family knowledge; the batch's other inputs
  (attention mask, token types) travel with the activation from stage to stage;
* a stage without the last block stops its forward at its last block (a hook raises the block's
  output, which the stage returns) and has its *after* pieces replaced by stand-ins.

Decoders, encoders (BERT-style, ViT), a PEFT-wrapped model (its base model is cut, adapters stay
in their layers) and plain block-list models are cut. Refused with :class:`UncuttableModelError`
(typed, naming the fix): encoder-decoders and two-tower models (two block stacks, no single
chain), models without a block list, and models whose forward does not run its blocks as a chain
(each block's input is the previous one's output). What the cut computes differently from the
whole model is refused by :mod:`.check` before training.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from composable_atorch.errors import CompositionError, ConfigError
from composable_atorch.transforms.compile import repeated_blocks


class UncuttableModelError(ConfigError):
    """A model pipeline_parallel cannot cut into stages: the reason and what to pass instead."""

    def __init__(self, model: str, reason: str, fix: str):
        self.field, self.value, self.allowed = "pipeline_parallel model", model, fix
        self.model, self.reason, self.fix = model, reason, fix
        CompositionError.__init__(self, f"pipeline_parallel cannot cut {model} into stages: {reason}. Fix: {fix}.")


SPLIT_FIX = "pass split=['<block list>.<i>', ...] naming the blocks where stages 1.. begin"


@dataclass
class Anatomy:
    """Where a model's blocks are and which pieces run before / after them."""

    path: str  #: qualified name of the block list ("" when the model itself is an nn.Sequential)
    blocks: list[nn.Module]
    pre: list[str] = field(default_factory=list)  #: pieces that run before the blocks (first stage)
    post: list[str] = field(default_factory=list)  #: pieces that run after them (last stage)
    hf: bool = False  #: called as an HF model (input_ids= on the first stage, inputs_embeds= after)
    source: str = "registration order"  #: how pre and post were told apart
    #: parameters held by a before piece and an after piece (tied embeddings): (first-stage name, last-stage name)
    tied: list[tuple[str, str]] = field(default_factory=list)
    #: what a block returns, seen on a probe forward: 0 a tensor, n a tuple of n (the hidden states first)
    block_returns: int = 0
    #: named inputs besides the first (an attention mask, token types) the stages hand on with the
    #: activation, in this order; set per step from the batch (a dict of tensors) by the runner
    carry: list[str] = field(default_factory=list)
    #: pieces every stage holds (their weights reach every block besides through the hidden states:
    #: DeBERTa's relative-position table); their gradients are summed over the pipeline
    shared: list[str] = field(default_factory=list)
    #: the whole model's probe forwards (check.Reference), one per input form, each stage is compared
    #: with on each; None: not run yet (empty: the probe could not run)
    references: list | None = None

    def weights(self, model: nn.Module) -> tuple[int, int]:
        """Parameters the first / last stage hold besides blocks (a tied weight counts on both)."""
        return (
            sum(_numel(model.get_submodule(p)) for p in self.pre),
            sum(_numel(model.get_submodule(p)) for p in self.post),
        )


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _name(model: nn.Module) -> str:
    return type(model).__name__


# ---------------------------------------------------------------------------------------------
# finding the blocks and the pieces
# ---------------------------------------------------------------------------------------------


def _refuse_hf_kind(model: nn.Module) -> None:
    """An HF model with two block stacks (encoder-decoder, two towers) has no single chain to cut."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model"):
        return
    if getattr(config, "is_encoder_decoder", False):
        raise UncuttableModelError(
            _name(model),
            "an encoder-decoder has two block stacks and every decoder block reads the encoder's output "
            "(cross-attention), so it is no single chain of blocks one activation runs through",
            "train it with ddp / fsdp / zero2 / tensor_parallel; pipeline_parallel cuts decoder-only and "
            "encoder-only models and plain chain models",
        )
    towers = [k for k in ("text_config", "vision_config", "audio_config") if getattr(config, k, None) is not None]
    if len(towers) >= 2:
        raise UncuttableModelError(
            _name(model),
            f"it has one block stack per modality ({', '.join(towers)}) run side by side on different inputs "
            "(two towers), so it is no single chain of blocks one activation runs through",
            "train it with ddp / fsdp / zero2 / tensor_parallel; pipeline_parallel cuts single-stack models",
        )


def _uniform_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) >= 2 and len({type(c) for c in m}) == 1
    ]


def find_blocks(model: nn.Module, split_paths: tuple[str, ...] = ()) -> tuple[str, nn.Module]:
    """(qualified name, module) of the list of blocks the stages are cut over.

    Named by ``split`` paths when given; else the model itself if it is an ``nn.Sequential``; else the
    longest outermost ``ModuleList`` / ``Sequential`` of one class, preferring the class the
    checkpoint / compile block detection (:func:`~composable_atorch.transforms.compile.repeated_blocks`)
    finds, so a Mixtral's experts do not outvote its decoder layers.
    """
    if split_paths:
        names = dict(model.named_modules())
        parents = set()
        for p in split_paths:
            hits = [n for n in names if n == p or n.endswith("." + p)]
            parent, _, idx = hits[0].rpartition(".") if len(hits) == 1 else ("", "", "")
            if len(hits) != 1 or not idx.isdigit() or not isinstance(names[parent], nn.ModuleList | nn.Sequential):
                raise ConfigError(
                    "pipeline_parallel.split",
                    p,
                    "the qualified name of one element of a block list (e.g. 'model.layers.4' or 'layers.4'); "
                    + ("it matches " + ", ".join(hits[:4]) if hits else "it names no module"),
                )
            parents.add(parent)
        if len(parents) != 1:
            raise ConfigError("pipeline_parallel.split", list(split_paths), "blocks of one block list")
        path = parents.pop()
        return path, names[path]
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return "", model
    lists = _uniform_lists(model)
    outer = [(n, m) for n, m in lists if not any(n.startswith(o + ".") for o, _ in lists if o != n)]
    favourite = set(repeated_blocks(model))
    outer = [(n, m) for n, m in outer if type(m[0]) in favourite] or outer
    if not outer:
        raise UncuttableModelError(
            _name(model),
            "the stage cutter knows models with a block list (an nn.ModuleList / nn.Sequential of at least two "
            "blocks of one class, as HF decoders, composable_atorch's GPT and most user models hold) and found none",
            "hold the repeated blocks in an nn.ModuleList, or pass an nn.Sequential, or " + SPLIT_FIX,
        )
    longest = max(len(m) for _, m in outer)
    top = [(n, m) for n, m in outer if len(m) == longest]
    if len(top) > 1:
        raise UncuttableModelError(
            _name(model),
            f"it holds several block lists of {longest} ({', '.join(n for n, _ in top)}): "
            "which one is the chain is ambiguous",
            f"pass split=['{top[0][0]}.1', ...] naming the list to cut",
        )
    return top[0]


def pieces(model: nn.Module, path: str) -> list[str]:
    """Qualified names of the outermost modules with parameters that neither are nor hold the block list."""
    out: list[str] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for sub, child in m.named_children():
            q = f"{prefix}.{sub}" if prefix else sub
            if q == path:
                continue
            if path.startswith(q + "."):
                walk(child, q)
            elif _numel(child):
                out.append(q)

    if path:
        walk(model, "")
    return out


def _pp_plan_order(model: nn.Module, path: str, found: list[str]) -> dict[str, str] | None:
    """pre / post of each piece from transformers' ``base_model_pp_plan`` (its keys are in forward order)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) if config is not None else None
    if not plan:
        return None
    base = getattr(model, "base_model", model)
    prefix = "" if base is model else getattr(model, "base_model_prefix", "")
    keys = [f"{prefix}.{k}" if prefix else k for k in plan]
    if path not in keys:
        return None
    at = keys.index(path)
    side = {}
    for p in found:
        if p in keys:
            side[p] = "pre" if keys.index(p) < at else "post"
        elif prefix and not p.startswith(prefix + "."):
            side[p] = "post"  # the head of a causal LM runs on the base model's output
        else:
            return None
    return side


def probe_input(model: nn.Module, an: Anatomy, length: int = 2, rows: int = 1) -> torch.Tensor | None:
    """``rows`` sequences of ``length`` tokens when the model starts with token ids, ``rows`` images of
    the config's size when it starts with pixels; None when the input is unknown."""
    config = getattr(model, "config", None)
    if an.hf and getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", 3)
        if not isinstance(size, int):
            return None
        g = torch.Generator().manual_seed(0)
        device = next(model.parameters()).device
        return torch.randn(rows, channels, size, size, generator=g).to(device)
    first = next((model.get_submodule(p) for p in pieces(model, an.path)), None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) if an.hf else None
    if vocab is None and isinstance(first, nn.Embedding):
        vocab = first.num_embeddings
    if vocab is None:
        return None
    device = next(model.parameters()).device
    if length == 2 and rows == 1:
        return torch.tensor([[1 % vocab, 2 % vocab]], device=device)
    at = torch.arange(length, device=device)
    return torch.stack([(at * 7 + 3 + 5 * r) % vocab for r in range(rows)])


def hidden_of(out):
    """The hidden states a block returns (a tensor, or the first element of a tuple / list)."""
    return out[0] if isinstance(out, tuple | list) else out


def _probe(model: nn.Module, an: Anatomy, found: list[str]) -> dict[str, str] | None:
    """pre / post of each piece from the order a one-sequence forward calls them; checks the chain.

    Raises UncuttableModelError when the blocks are not called one after another, each on the
    previous one's output. None when the model cannot be probed (weights not real, input unknown).
    """
    params = list(model.parameters())
    if not params or any(p.is_meta or hasattr(p, "to_local") for p in params):  # meta or DTensor weights
        return None
    ids = probe_input(model, an)
    if ids is None:
        return None
    calls: list[tuple[str, object]] = []
    handles = []
    for p in found:
        handles.append(model.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: calls.append((p, None))))
    for i, b in enumerate(an.blocks):

        def pre(m, args, kwargs, i=i):
            calls.append((f"block {i}", _first_arg(m, args, kwargs)))

        def post(m, args, out, i=i):
            calls.append((f"out {i}", hidden_of(out)))

        handles.append(b.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(b.register_forward_hook(post))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(**{getattr(model, "main_input_name", "input_ids"): ids}) if an.hf else model(ids)
    except CompositionError:
        raise
    except Exception:  # noqa: BLE001 - a model we cannot probe falls back to registration order
        return None
    finally:
        for h in handles:
            h.remove()
    order = [c for c, _ in calls if c.startswith("block ")]
    broken = order != [f"block {i}" for i in range(len(an.blocks))]
    outs = {int(c.split()[1]): v for c, v in calls if c.startswith("out ")}
    ins = {int(c.split()[1]): v for c, v in calls if c.startswith("block ")}
    broken = broken or any(ins[i] is not outs.get(i - 1) for i in range(1, len(an.blocks)))
    if broken:
        raise UncuttableModelError(
            _name(model),
            f"its forward does not run the blocks of {an.path or 'the model'} as a chain (each once, in order, "
            "each on the previous block's output), so the stages cannot hand one activation on",
            "pipeline a model whose forward is embeddings -> blocks -> head, or "
            + SPLIT_FIX
            + " of a list that is a chain",
        )
    first = next(i for i, (c, _) in enumerate(calls) if c == "block 0")
    last = max(i for i, (c, _) in enumerate(calls) if c == f"out {len(an.blocks) - 1}")
    side = {}
    for p in found:
        at = [i for i, (c, _) in enumerate(calls) if c == p]
        if any(first < i < last for i in at) or (any(i < first for i in at) and any(i > last for i in at)):
            raise UncuttableModelError(
                _name(model),
                f"{p} runs among the blocks (or both before and after them), so no single stage can hold it",
                "move it into the blocks, or " + SPLIT_FIX,
            )
        side[p] = "pre" if at and at[0] < first else "post" if at else None
    registered = _registration_order(model, an.path, found)
    return {p: s or registered[p] for p, s in side.items()}


def _registration_order(model: nn.Module, path: str, found: list[str]) -> dict[str, str]:
    names = [n for n, _ in model.named_modules()]
    at = names.index(path)
    return {p: "pre" if names.index(p) < at else "post" for p in found}


def _first_arg(module: nn.Module, args, kwargs):
    if args:
        return args[0]
    name = hidden_name(module)
    return kwargs.get(name)


def hidden_name(module: nn.Module) -> str:
    params = list(inspect.signature(module.forward).parameters)
    return params[0] if params else "hidden_states"


def anatomy_of(model: nn.Module, split_paths: tuple[str, ...] = ()) -> Anatomy:
    """The model's :class:`Anatomy`; typed errors for what cannot be cut."""
    _refuse_hf_kind(model)
    path, blocks = find_blocks(model, split_paths)
    an = Anatomy(path, list(blocks), hf=hasattr(model, "config") and hasattr(model, "base_model"))
    found = pieces(model, path)
    side = _pp_plan_order(model, path, found)
    if side is not None:
        an.source = "transformers' base_model_pp_plan"  # it names the order: no probe forward needed
    else:
        side = _probe(model, an, found)
        if side is not None:
            an.source = "a probe forward"
        else:
            side = _registration_order(model, path, found)
    an.pre = [p for p in found if side[p] == "pre"]
    an.post = [p for p in found if side[p] == "post"]
    an.tied = _tied(model, an)
    return an


def _tied(model: nn.Module, an: Anatomy) -> list[tuple[str, str]]:
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)

    def inside(n, pieces_):
        return any(n.startswith(q + ".") for q in pieces_)

    out = []
    for names in by_id.values():
        pre = [n for n in names if inside(n, an.pre)]
        post = [n for n in names if inside(n, an.post)]
        if pre and post:
            out.append((pre[0], post[0]))
    return out

"""The DeepSpeed pipeline built from an unmodified model: its module list walked into layer specs.

A model written with plain torch is read as a sequence, as ATorch's ``PipeModuleFromRecordedMeta``
does: ``nn.ModuleList`` / ``nn.Sequential`` elements and leaf modules, in definition order
(``model.embed_tokens, model.layers.0 .. N, model.norm, model.rotary_emb, lm_head`` for a Llama).
Each becomes a DeepSpeed ``LayerSpec`` whose ``build`` runs only on the ranks of the stage that
owns it, so only this stage's layers are ever allocated. Building a layer:

1. its recorded init args rebuild it on the CPU (:func:`~composable_atorch.runtime.record_init.build_recorded`)
   under a stream seeded by ``base_seed + its index``, the Hugging Face root's ``_init_weights``
   applied when the model has one: every rank (any stage, tensor or data coordinate) that builds
   layer i gets the same weights, those of the unsharded model;
2. the sub-layers the TPInfo names are replaced by their Megatron-style shard (:mod:`.ds3d_tp`),
   attributes it shrinks are divided, dropouts it names run in their own random streams;
3. its forward is patched to pass tuples along the pipe (a custom patcher from the config, a
   built-in one for the model families known here, or :func:`default_patcher`).

With ``tie_first`` the first module (the vocabulary embedding) is a ``TiedLayerSpec`` and the same
module computes the logits at the end through the logit helper; DeepSpeed keeps the two copies on
the first and last stages equal (it broadcasts the weight and all-reduces its gradient between them).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from composable_atorch.errors import ConfigError
from composable_atorch.runtime.record_init import build_recorded, hf_init_weights, is_meta, is_recorded
from composable_atorch.transforms.parallel.ds3d.tp import (
    LAYERS,
    RandomStream,
    VocabParallelEmbedding,
    copy_to_group,
    gather_from_group,
    seeded,
    with_stream,
)

# ---------------------------------------------------------------------------------------------
# the module list
# ---------------------------------------------------------------------------------------------


def module_list(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(qualified name, module), ...]`` in definition order (see the module doc)."""
    out: list[tuple[str, nn.Module]] = []

    def walk(m: nn.Module, name: str) -> None:
        if isinstance(m, nn.ModuleList | nn.Sequential):
            out.extend((f"{name}.{i}" if name else str(i), layer) for i, layer in enumerate(m))
        elif not m._modules:
            out.append((name, m))
        else:
            for sub, child in m._modules.items():
                if child is not None:
                    walk(child, f"{name}.{sub}" if name else sub)

    walk(model, "")
    return out


def block_class(entries: list[tuple[str, nn.Module]]) -> tuple[str, int]:
    """The transformer block class and how many there are: the most common class among the
    ``ModuleList`` elements (names ending in an index), so a GPT's two embeddings do not outvote its
    two blocks (ATorch counts every entry)."""
    listed = [type(m).__name__ for n, m in entries if n.rpartition(".")[2].isdigit()]
    return Counter(listed or [type(m).__name__ for _, m in entries]).most_common(1)[0]


# ---------------------------------------------------------------------------------------------
# forward patchers and logit helpers
# ---------------------------------------------------------------------------------------------


def default_patcher(forward, module):
    """Take as many leading pipe tensors as ``forward`` has parameters, replace as many as it returns.

    DeepSpeed passes a tensor or a tuple of tensors between layers; a module that needs fewer
    (a norm) passes the rest (a mask) along unchanged.
    """
    try:
        kinds = [p.kind for p in inspect.signature(forward).parameters.values()]
    except (TypeError, ValueError):
        kinds = [inspect.Parameter.POSITIONAL_ONLY]
    takes = (
        None
        if inspect.Parameter.VAR_POSITIONAL in kinds
        else sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    )

    @functools.wraps(forward)
    def pipe_forward(inputs):
        if isinstance(inputs, torch.Tensor):
            return forward(inputs)
        out = forward(*(inputs if takes is None else inputs[:takes]))
        out = out if isinstance(out, tuple) else (out,)
        rest = tuple(inputs[len(out) :])
        whole = (*out, *rest)
        return whole[0] if len(whole) == 1 else whole

    return pipe_forward


def _first(lm_output):
    if isinstance(lm_output, torch.Tensor):
        return lm_output
    if isinstance(lm_output, tuple) and lm_output:
        return lm_output[0]
    raise ConfigError(
        "pipeline output before the logits",
        type(lm_output).__name__,
        "a tensor or a tuple whose first element is the hidden states",
    )


def default_logit_helper(embed: nn.Module, lm_output):
    """Logits on the tied embedding: ``hidden @ embedding.weight.T``."""
    return F.linear(_first(lm_output), embed.weight)


def vocab_parallel_logit_helper(embed: nn.Module, lm_output):
    """Logits on a vocabulary-parallel tied embedding: each tensor rank computes its vocabulary slice
    (its input copied to the group, so the hidden-state gradient is summed over the slices), then
    the slices are gathered, so the user's loss sees the whole vocabulary as in the original model.
    (ATorch's helper stops before the gather and needs its vocab-parallel cross-entropy.)"""
    if not isinstance(embed, VocabParallelEmbedding):
        return default_logit_helper(embed, lm_output)
    h = copy_to_group(_first(lm_output), embed.group)
    return gather_from_group(F.linear(h, embed.weight), embed.group)


def _contiguous(forward):
    """Tensors leave each layer contiguous.

    DeepSpeed sends a stage's output as it is, and gloo refuses strided tensors.
    """

    @functools.wraps(forward)
    def contiguous(inputs):
        out = forward(inputs)
        if isinstance(out, torch.Tensor):
            return out.contiguous()
        return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in out)

    return contiguous


def _last_output(forward):
    """The pipeline's last layer hands the loss one tensor: the first of a tuple (the logits)."""

    @functools.wraps(forward)
    def last(inputs):
        return _first(forward(inputs))

    return last


# -- built-in patchers of the model families known here -------------------------------------------


def gpt_patcher(prefix: str = ""):
    """composable_atorch's GPT: ``pos`` adds position embeddings to the token embeddings it receives."""

    def pos_patcher(forward, module):
        @functools.wraps(forward)
        def pipe_forward(x):
            return x + forward(torch.arange(x.size(1), device=x.device))

        return pipe_forward

    return {f"{prefix}pos": pos_patcher}


def llama_patcher(config, *, prefix: str = "model.", rotary_cls=None) -> dict:
    """Hugging Face Llama-family (``LlamaForCausalLM`` / ``LlamaModel``): the pipe carries
    ``(hidden_states, position_ids)``; every decoder layer computes its rotary embeddings itself
    (the model computes them once, in a module listed after the final norm); attention is causal
    with no mask (no padding), as the model's own forward with ``attention_mask=None``.
    ``prefix`` is ``"model."`` for a causal LM, ``""`` for a bare ``LlamaModel``."""
    n_layers = int(config.num_hidden_layers)
    holder: dict[str, Any] = {}

    def rotary():
        if "rotary" not in holder:
            cls = rotary_cls
            if cls is None:
                from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as cls
            holder["rotary"] = cls(config=config).to("cpu")
        return holder["rotary"]

    def embed_patcher(forward, module):
        @functools.wraps(forward)
        def pipe_forward(inputs):
            ids = inputs if isinstance(inputs, torch.Tensor) else inputs[0]
            position_ids = torch.arange(ids.size(1), device=ids.device).unsqueeze(0).expand(ids.size(0), -1)
            return forward(ids), position_ids

        return pipe_forward

    def layer_patcher(forward, module):
        @functools.wraps(forward)
        def pipe_forward(inputs):
            hidden, position_ids = inputs[0], inputs[1]
            cos_sin = rotary()(hidden, position_ids)
            out = forward(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin)
            return (out[0] if isinstance(out, tuple) else out), position_ids

        return pipe_forward

    def norm_patcher(forward, module):
        @functools.wraps(forward)
        def pipe_forward(inputs):
            return forward(inputs[0] if isinstance(inputs, tuple) else inputs)

        return pipe_forward

    def passthrough(forward, module):
        return lambda inputs: inputs

    patchers = {
        f"{prefix}embed_tokens": embed_patcher,
        f"{prefix}norm": norm_patcher,
        f"{prefix}rotary_emb": passthrough,
    }
    patchers.update({f"{prefix}layers.{i}": layer_patcher for i in range(n_layers)})
    return patchers


def builtin_patcher(model: nn.Module) -> tuple[dict, str | None]:
    """``(patchers, family)`` for a model family known here, or ``({}, None)``."""
    names = dict(model.named_children())
    if all(k in names for k in ("tok", "pos", "blocks", "ln_f", "head")):
        return gpt_patcher(), "composable_atorch GPT"
    for prefix, base in (("model.", names.get("model")), ("", model)):
        if (
            base is not None
            and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and hasattr(model, "config")
        ):
            return llama_patcher(
                model.config, prefix=prefix, rotary_cls=type(base.rotary_emb)
            ), f"Hugging Face {type(model).__name__} (Llama family)"
    return {}, None


# ---------------------------------------------------------------------------------------------
# the layer specs
# ---------------------------------------------------------------------------------------------


@dataclass
class StageBuilder:
    """What building a layer needs, shared by every spec of one pipeline: the TP placements and groups."""

    root: nn.Module
    base_seed: int
    shard: dict[str, tuple[str, dict]] = field(default_factory=dict)  # qualname -> (kind, kwargs)
    shrink: dict[str, tuple] = field(default_factory=dict)
    drops: dict[str, str] = field(default_factory=dict)  # qualname -> replic_drop / parallel_drop
    tp_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    replic_stream: RandomStream | None = None
    parallel_stream: RandomStream | None = None
    #: module_replace on a built layer -> (the layer, what it did); None without module_replace
    rewrite: Any = None
    rewrite_notes: list = field(default_factory=list)

    def build(self, name: str, meta: nn.Module, index: int) -> nn.Module:
        with seeded(self.base_seed + index):
            module = build_recorded(meta, hf_init_weights(self.root))
        if self.rewrite is not None:  # before sharding: the sharded names are the replaced modules' own
            module, notes = self.rewrite(module)
            self.rewrite_notes.extend(notes)
        if self.tp_size > 1:
            module = self._shard(name, module)
        return module

    def _shard(self, name: str, module: nn.Module) -> nn.Module:
        def full(sub: str) -> str:
            return f"{name}.{sub}" if sub and name else (sub or name)

        for sub, m in list(module.named_modules()):
            q = full(sub)
            if q in self.shard:
                kind, kw = self.shard[q]
                new = LAYERS[kind](m, self.tp_group, self.tp_rank, self.tp_size, int(kw.get("stride", 1)))
                if not sub:
                    module = new
                    continue
                parent_name, _, attr = sub.rpartition(".")
                setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)
            if q in self.drops:
                with_stream(m, self.replic_stream if self.drops[q] == "replic_drop" else self.parallel_stream)
            for attr in self.shrink.get(q, ()):
                setattr(m, attr, getattr(m, attr) // self.tp_size)
        return module


def _spec_classes():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    class RecordedLayerSpec(LayerSpec):
        """A LayerSpec built from a recorded (meta) module of the user's model."""

        def __init__(self, builder, name, meta, index, patch_fn, last):
            super().__init__(type(meta))
            self.builder, self.name, self.meta, self.index, self.patch_fn, self.last = (
                builder,
                name,
                meta,
                index,
                patch_fn,
                last,
            )

        def __repr__(self):
            return f"{type(self.meta).__name__}({self.name})"

        def build(self, log=False):
            module = self.builder.build(self.name, self.meta, self.index)
            forward = _contiguous(self.patch_fn(module.forward, module))
            module.forward = _last_output(forward) if self.last else forward
            return module

    class RecordedTiedLayerSpec(TiedLayerSpec):
        """The tied first module (vocabulary embedding); ``forward_fn`` set: the logits at the end."""

        def __init__(self, builder, key, name, meta, index, patch_fn, forward_fn=None):
            super().__init__(key, type(meta), forward_fn=forward_fn, tied_weight_attr="weight")
            self.builder, self.name, self.meta, self.index, self.patch_fn = builder, name, meta, index, patch_fn

        def __repr__(self):
            return f"Tied {type(self.meta).__name__}({self.name})"

        def build(self, log=False):
            module = self.builder.build(self.name, self.meta, self.index)
            if self.forward_fn is None:  # DeepSpeed builds a tied module once; the logit layer calls forward_fn on it
                module.forward = _contiguous(self.patch_fn(module.forward, module))
            return module

    return RecordedLayerSpec, RecordedTiedLayerSpec


def stage_bounds(is_block: list[bool], stages: int) -> list[int]:
    """Spec indices where each stage starts (and the end): the blocks split evenly (earlier stages take
    the remainder), layers before the first block on stage 0, the others with the block before them.
    DeepSpeed's ``type:`` balancing may leave a stage without blocks (seen: 0 / 2 on a 2-block GPT)."""
    blocks = [i for i, b in enumerate(is_block) if b]
    n = len(blocks)
    counts = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
    starts, k = [0], 0
    for c in counts[:-1]:
        k += c
        starts.append(blocks[k])
    return [*starts, len(is_block)]


def pipeline_module_class():
    """DeepSpeed's PipelineModule, with the stages cut by :func:`stage_bounds` over the block class."""
    from deepspeed.pipe import PipelineModule

    class BlockBalancedPipelineModule(PipelineModule):
        def __init__(self, *args, block_name: str, **kwargs):
            self._block_name = block_name
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            is_block = [type(getattr(s, "meta", s)).__name__ == self._block_name for s in self._layer_specs]
            self.parts = stage_bounds(is_block, self.num_stages)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return BlockBalancedPipelineModule


def tied_key(name: str) -> str:
    return name.replace(".", "_")  # nn.ModuleDict keys cannot contain dots


def layer_specs(builder: StageBuilder, entries, patchers: dict, tie_first: bool, logit_helper) -> list:
    """The specs for ``entries`` (the module list, tied head already dropped)."""
    layer_cls, tied_cls = _spec_classes()
    specs = []
    first_name, first = entries[0]
    rest = entries[1:] if tie_first else entries
    if tie_first:
        specs.append(
            tied_cls(builder, tied_key(first_name), first_name, first, 0, patchers.get(first_name, default_patcher))
        )
    for i, (name, meta) in enumerate(rest, start=1 if tie_first else 0):
        last = not tie_first and i == len(entries) - 1
        specs.append(layer_cls(builder, name, meta, i, patchers.get(name, default_patcher), last))
    if tie_first:
        specs.append(tied_cls(builder, tied_key(first_name), first_name, first, 0, None, forward_fn=logit_helper))
    return specs


def check_model(model: nn.Module, entries, tie_first: bool) -> tuple[list, str | None]:
    """``(entries without the tied head, name of the head dropped)``; ConfigError for what cannot be built."""
    unbuildable = [n for n, m in entries if is_meta(m) and not is_recorded(m)]
    if unbuildable:
        raise ConfigError(
            "ds_3d_parallel model",
            f"meta modules without recorded init args: {unbuildable[:4]}",
            "build the model inside `with composable_atorch.record_module_init():`, or pass a real model",
        )
    if not tie_first:
        return entries, None
    first_name, first = entries[0]
    if getattr(first, "weight", None) is None or first.weight.dim() != 2:
        raise ConfigError(
            "DeepSpeed3DParallelConfig.tie_first",
            True,
            f"False: the first module {first_name} ({type(first).__name__}) is not a vocabulary embedding",
        )
    last_name, last = entries[-1]
    w = getattr(last, "weight", None)
    if w is first.weight:
        return entries[:-1], last_name
    if isinstance(w, torch.Tensor) and w.dim() == 2 and first.weight.shape[0] in w.shape and len(entries) > 2:
        raise ConfigError(
            "DeepSpeed3DParallelConfig.tie_first",
            True,
            f"False: the output layer {last_name} has its own weight, not tied to {first_name} "
            "(e.g. tie_word_embeddings=False); tying them would train a different model",
        )
    return entries, None

"""module_replace: swap modules for fused implementations, keeping parameter names and weights.

What it swaps, each as a named *replace pair* (ATorch's ``register_replace_pair`` registry):

* the library's own GPT attention (written out naive on purpose) for a subclass calling
  ``F.scaled_dot_product_attention`` — on this CPU a fused flash kernel, ~4x faster at seq 512 —
  or flash-attn's kernel where flash-attn imports on a CUDA GPU of sm80+ and the plan trains in
  fp16/bf16 (those two pairs are registered by :mod:`composable_atorch.models.gpt`, which owns
  the classes: transforms sit below models and never import them);
* transformers models (GPT2, Llama, BERT, CLIP...): transformers 5 picks the attention kernel
  itself, so the pair flips ``model.set_attn_implementation(...)`` instead of swapping classes;
* transformers' hand-written ``LlamaRMSNorm`` for torch's ``F.rms_norm``, on CUDA only: there torch
  runs one fused kernel; on the CPU it measured no faster than the module's own arithmetic.

torch's ``nn.LayerNorm`` is already one fused kernel (aten ``native_layer_norm``) on CPU and CUDA,
so it is left alone and explain() says so.

Classes of optional packages are looked up only in ``sys.modules``: a model built from
transformers has imported it already, and a plan for any other model must not pay transformers'
import time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from composable_atorch.core.contract import (
    AllOf,
    Contract,
    DeviceKind,
    MinComputeCapability,
    Package,
    Requirement,
    Stage,
    unmet,
)
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.policy import PRECISION_READS, PrecisionPolicy

ALL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


# ---------------------------------------------------------------------------------------------
# Built-in targets
# ---------------------------------------------------------------------------------------------


def _llama_rmsnorm() -> type | None:
    module = sys.modules.get("transformers.models.llama.modeling_llama")
    return getattr(module, "LlamaRMSNorm", None)


_FUSED_RMSNORM: dict[type, type] = {}


def _fused_rmsnorm_class(source: type) -> type:
    """A subclass of transformers' RMSNorm whose forward is torch's (fused on CUDA) ``F.rms_norm``."""
    if source not in _FUSED_RMSNORM:

        def forward(self, hidden_states):
            return F.rms_norm(hidden_states, (hidden_states.size(-1),), self.weight, self.variance_epsilon)

        _FUSED_RMSNORM[source] = type(
            f"Fused{source.__name__}", (source,), {"forward": forward, "__module__": __name__}
        )
    return _FUSED_RMSNORM[source]


# ---------------------------------------------------------------------------------------------
# Replace pairs
# ---------------------------------------------------------------------------------------------


#: flash-attn's kernel: the package importing, on a CUDA GPU of sm80 or newer (declared once, as data).
FLASH_ATTN = AllOf(
    name="flash-attn",
    parts=(Package(name="flash_attn"), MinComputeCapability(major=8, minor=0), DeviceKind(kinds=("cuda",))),
)
#: torch's rms_norm is one fused kernel on CUDA; on the CPU it measured no faster than the module's arithmetic.
FUSED_RMS_NORM = AllOf(
    name="torch's fused rms_norm kernel (on the CPU it measured no faster)", parts=(DeviceKind(kinds=("cuda",)),)
)


@dataclass(frozen=True)
class ReplacePair:
    """One replacement rule.

    ``source`` is the exact class replaced (a callable returning it, or None when its package is
    not loaded); ``target`` the class put in its place. A target that subclasses the source and
    adds no ``__init__`` is swapped in place by changing the instance's class (same parameters,
    same names); any other target is built as ``target(source_module)`` (ATorch's convention) and
    must keep the parameter names. ``switch`` instead names a transformers attention
    implementation set through ``set_attn_implementation``. ``requires`` are declared
    :class:`~composable_atorch.core.contract.Requirement` values (device, compute capability,
    package); ``needs(env)`` says which is unmet, or None.
    """

    name: str
    source: type | Callable[[], type | None] | None = None
    target: type | Callable[[type], type] | None = None
    supported_dtypes: frozenset = ALL_DTYPES
    requires: tuple[Requirement, ...] = ()
    switch: str | None = None

    def needs(self, env: Environment) -> str | None:
        """What the environment lacks for this pair (the first unmet declared requirement), or None."""
        return unmet(self.requires, env)

    def source_class(self) -> type | None:
        if isinstance(self.source, type) or self.source is None:
            return self.source
        return self.source()

    def target_class(self, source: type) -> type:
        return self.target if isinstance(self.target, type) else self.target(source)


#: torch's own norms are left alone; why, for explain().
_TORCH_NORMS = {
    nn.LayerNorm: "is already one fused kernel (aten native_layer_norm) on CPU and CUDA",
    nn.RMSNorm: "is torch's own rms_norm (one fused kernel on CUDA; nothing faster exists for the CPU)",
}

_PAIRS: dict[str, ReplacePair] = {}


def _add(pair: ReplacePair) -> None:
    _PAIRS[pair.name] = pair


# Order matters: for one source, the first usable pair wins (flash before sdpa).
_add(
    ReplacePair(
        "hf_flash_attention_2", supported_dtypes=HALF_DTYPES, requires=(FLASH_ATTN,), switch="flash_attention_2"
    )
)
_add(ReplacePair("hf_sdpa", switch="sdpa"))
_add(ReplacePair("llama_rmsnorm_fused", _llama_rmsnorm, _fused_rmsnorm_class, requires=(FUSED_RMS_NORM,)))


def register_replace_pair(
    name: str,
    source_cls: type | None = None,
    target_cls: type | None = None,
    *,
    supported_dtypes=ALL_DTYPES,
    pair_cls: tuple[type, type] | None = None,
    requires: tuple[Requirement, ...] = (),
) -> ReplacePair:
    """Register a user pair: ``register_replace_pair("mine", Src, Tgt, supported_dtypes={torch.bfloat16})``.

    ATorch's keyword form ``register_replace_pair(name, supported_dtypes=..., pair_cls=(Src, Tgt))``
    works too. ``module_replace()`` then swaps every module of exactly class ``Src``.
    ``requires`` declares what the environment must provide (e.g. :data:`FLASH_ATTN`); where it
    does not, the pair is not used and explain() says why.
    """
    if pair_cls is not None:
        if source_cls is not None or target_cls is not None:
            raise ConfigError(
                "register_replace_pair",
                name,
                "either source_cls and target_cls, or pair_cls=(source, target), not both",
            )
        if not isinstance(pair_cls, tuple | list) or len(pair_cls) != 2:
            raise ConfigError("register_replace_pair pair_cls", pair_cls, "a (source_class, target_class) pair")
        source_cls, target_cls = pair_cls
    if not isinstance(name, str) or not name:
        raise ConfigError("register_replace_pair name", name, "a non-empty string")
    for field, cls in (("source_cls", source_cls), ("target_cls", target_cls)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError(f"register_replace_pair {field}", cls, "an nn.Module subclass")
    dtypes = frozenset(supported_dtypes) if isinstance(supported_dtypes, set | frozenset | list | tuple) else None
    if not dtypes or not dtypes <= ALL_DTYPES:
        raise ConfigError(
            "register_replace_pair supported_dtypes",
            supported_dtypes,
            "a non-empty set of torch.float32, torch.float16, torch.bfloat16",
        )
    requires = tuple(requires)
    if not all(isinstance(r, Requirement) for r in requires):
        raise ConfigError("register_replace_pair requires", requires, "Requirement values, e.g. (FLASH_ATTN,)")
    pair = ReplacePair(name, source_cls, target_cls, dtypes, requires=requires)
    if name in _PAIRS and _PAIRS[name] != pair:
        raise ConfigError(
            "register_replace_pair name", name, f"a name not already registered (taken: {', '.join(_PAIRS)})"
        )
    _add(pair)
    return pair


#: ATorch's pair names (atorch/auto/opt_lib/module_replace_optimization.py) -> our pairs, or None and why.
ATORCH_PAIRS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "HF_BertAttention_FA": (("hf_flash_attention_2",), "transformers' own flash-attention 2"),
    "HF_CLIPAttention_FA": (("hf_flash_attention_2",), "transformers' own flash-attention 2"),
    "HF_GPT2Attention_FA": (("hf_flash_attention_2",), "transformers' own flash-attention 2"),
    "MultiheadAttention_FA": (
        None,
        "torch's nn.MultiheadAttention already calls scaled_dot_product_attention (fused flash kernel)",
    ),
    "LayerNorm_Apex": (
        None,
        "torch's nn.LayerNorm is already one fused kernel (aten native_layer_norm); apex is not used",
    ),
}


def replace_pairs() -> dict[str, ReplacePair]:
    """Registered pairs by name, in the order they are tried."""
    return dict(_PAIRS)


# ---------------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------------


def training_dtype(ctx: ApplyContext) -> torch.dtype:
    """The dtype the plan computes in (see :class:`~composable_atorch.transforms.policy.PrecisionPolicy`)."""
    return PrecisionPolicy.of(ctx).compute_dtype


def _dtype_label(dtypes) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _hf_pretrained() -> type | None:
    transformers = sys.modules.get("transformers")
    return None if transformers is None else transformers.PreTrainedModel


def _present(model: nn.Module, pair: ReplacePair) -> bool:
    """Whether the model holds anything this pair could act on (only those are reported)."""
    source = _hf_pretrained() if pair.switch else pair.source_class()
    if source is None:
        return False
    if pair.switch:
        return any(isinstance(m, source) for m in model.modules())
    return any(type(m) is source for m in model.modules())


def _set_child(model: nn.Module, qualname: str, new: nn.Module) -> None:
    parent, _, leaf = qualname.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


class _Notes:
    """What ModuleReplace.apply reads and writes of a TrainState: the model and its notes."""

    def __init__(self, model: nn.Module):
        self.model, self.lines = model, []

    def note(self, _step: str, text: str) -> None:
        self.lines.append(text)


@dataclass(frozen=True)
class ModuleReplace(Transform):
    """Swap modules for fused implementations (see the module docstring); names and weights kept.

    ``pairs`` names the replace pairs to try (None: every registered one, in registration order).
    ``ignored`` holds ATorch pair names that have no meaning here, each with why: ATorch's scripts
    name them (``"LayerNorm_Apex"``), so they are accepted and explain() says they have no effect.
    """

    name = "module_replace"
    contract = Contract(stage=Stage.MODULE_REWRITE, roles=("module_replace",), reads=PRECISION_READS)

    pairs: tuple[str, ...] | None = None
    ignored: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        ignored = tuple((str(n), str(why)) for n, why in (self.ignored or ()))
        object.__setattr__(self, "ignored", ignored)
        if self.pairs is None:
            return
        pairs = (self.pairs,) if isinstance(self.pairs, str) else tuple(self.pairs)
        unknown = [p for p in pairs if p not in _PAIRS]
        if unknown or not (pairs or ignored):
            raise ConfigError(
                "module_replace.pairs",
                unknown[0] if unknown else pairs,
                f"names of registered pairs: {', '.join(_PAIRS)}",
            )
        object.__setattr__(self, "pairs", pairs)

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's config: None (every pair), or ``{pair_name: replace_config}``.

        Pair names are ours or ATorch's (:data:`ATORCH_PAIRS` maps them); a replace_config may be
        None or ATorch's default for the pair (targets here are built from the source module).
        """
        if config is None:
            return cls()
        if isinstance(config, dict) and "pairs" not in config:
            names: list[str] = []
            ignored: list[tuple[str, str]] = []
            for key, value in config.items():
                if value not in (None, {}, {"need_src_module": True}, {"init_from_attr": True}):
                    raise ConfigError(
                        f"module_replace config[{key!r}]",
                        value,
                        "None or ATorch's default (pairs here are built from the source module)",
                    )
                if key in ATORCH_PAIRS:
                    mapped, why = ATORCH_PAIRS[key]
                    if mapped is None:
                        ignored.append((key, why))
                        continue
                    names.extend(n for n in mapped if n not in names)
                elif key not in names:
                    names.append(key)
            return cls(pairs=tuple(names), ignored=tuple(ignored))
        return super().from_seed(config)

    @classmethod
    def candidates(cls, search):
        return (cls(),)

    def check(self, model: nn.Module, degree: int = 1) -> list[str]:
        """The search's planning check (``auto.space.planning_admit``): a model holding no module any of
        the pairs acts on would train exactly as without this step, so the plan is refused there at no
        trial cost (it would double the space with copies of other plans). Applying it stays allowed
        (ATorch's configs name it for every model; explain() says nothing matched)."""
        names = tuple(_PAIRS) if self.pairs is None else self.pairs
        if not any(_present(model, _PAIRS[n]) for n in names):
            raise ConfigError(
                "module_replace",
                ", ".join(names) or "no pair",
                f"a model holding a module one of these pairs replaces ({type(model).__name__} holds none: "
                "the plan would be the same as without module_replace)",
            )
        return []

    def describe(self):
        tried = "all registered pairs" if self.pairs is None else ", ".join(self.pairs) or "no pair"
        skipped = "".join(f"; {n}: no effect here, {why}" for n, why in self.ignored)
        return f"module_replace({tried}{skipped})"

    def rewrite(self, module: nn.Module, ctx: ApplyContext) -> tuple[nn.Module, list[str]]:
        """The same replacement on one module, outside a plan's state: ds_3d_parallel calls it on each
        layer it builds from the recorded init args (swaps made in the meta model are not recorded)."""
        notes = _Notes(module)
        self.apply(notes, ctx)
        return notes.model, notes.lines

    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        model, env, dtype = state.model, ctx.env, training_dtype(ctx)
        usable, unmatched = [], []
        for name, why in self.ignored:
            state.note(self.name, f"{name}: no effect here: {why}")
        for pair in (_PAIRS[n] for n in (tuple(_PAIRS) if self.pairs is None else self.pairs)):
            if not _present(model, pair):
                unmatched.append(pair.name)
            elif pair.needs is not None and (missing := pair.needs(env)):
                state.note(self.name, f"{pair.name}: not used, needs {missing}")
            elif dtype not in pair.supported_dtypes:
                state.note(
                    self.name,
                    f"{pair.name}: not used, it supports {_dtype_label(pair.supported_dtypes)} and this plan trains in "
                    f"{_dtype_label({dtype})}",
                )
            else:
                usable.append(pair)
        claimed: set[int] = set()
        for pair in usable:
            done = (
                self._switch_attention(model, pair, claimed, state)
                if pair.switch
                else self._replace(model, pair, claimed, state)
            )
            if not done:
                unmatched.append(pair.name)
        if unmatched:
            state.note(self.name, f"no module matched: {', '.join(unmatched)}")
        norms = {type(m) for m in model.modules() if type(m) in _TORCH_NORMS}
        for norm in sorted(norms, key=lambda c: c.__name__):
            state.note(self.name, f"left alone: torch's {norm.__name__} {_TORCH_NORMS[norm]}")
        return state

    def _replace(self, model: nn.Module, pair: ReplacePair, claimed: set[int], state: TrainState) -> bool:
        source = pair.source_class()
        if source is None:
            return False
        target = pair.target_class(source)
        found = [(q, m) for q, m in model.named_modules() if type(m) is source and id(m) not in claimed]
        if not found:
            return False
        if any(q == "" for q, _ in found):
            raise ConfigError(
                f"replace pair {pair.name!r}",
                source.__name__,
                "a pair for a submodule of the model, not the model's own class",
            )
        in_place = issubclass(target, source) and "__init__" not in target.__dict__
        new_modules = []
        for qualname, module in found:  # build all first: a bad target fails before the model changes
            new = module if in_place else target(module)
            before, after = [n for n, _ in module.named_parameters()], [n for n, _ in new.named_parameters()]
            if before != after:
                raise ConfigError(
                    f"replace pair {pair.name!r} target {target.__name__}",
                    f"parameters {after[:4]}",
                    f"a module with the same parameter names as {source.__name__} ({before[:4]})",
                )
            new_modules.append((qualname, module, new))
        for qualname, module, new in new_modules:
            if in_place:
                module.__class__ = target  # same object, same parameters: nothing else to rebind
                claimed.add(id(module))
            else:
                _set_child(model, qualname, new)
                claimed.update(id(m) for m in module.modules())  # its children now belong to the new module
        how = "class swapped in place" if in_place else f"built as {target.__name__}(module)"
        names = ", ".join(q for q, _, _ in new_modules[:6]) + (" ..." if len(new_modules) > 6 else "")
        state.note(
            self.name,
            f"{pair.name}: {len(new_modules)} x {source.__name__} -> {target.__name__} ({how}; parameter names "
            f"unchanged): {names}",
        )
        return True

    def _switch_attention(self, model: nn.Module, pair: ReplacePair, claimed: set[int], state: TrainState) -> bool:
        pretrained = _hf_pretrained()
        if pretrained is None:
            return False
        roots, seen = [], set()
        for qualname, module in model.named_modules():
            if isinstance(module, pretrained) and not any(qualname.startswith(f"{r}.") or r == "" for r in seen):
                roots.append((qualname, module))
                seen.add(qualname)
        done = False
        for qualname, module in roots:
            if id(module) in claimed:
                continue
            label = f"{type(module).__name__}" + (f" at {qualname}" if qualname else "")
            before = module.config._attn_implementation
            flag = ("_supports_sdpa",) if pair.switch == "sdpa" else ("_supports_flash_attn", "_supports_flash_attn_2")
            supported = any(getattr(module, f, False) for f in flag)
            if not supported:
                state.note(
                    self.name, f"{pair.name}: {label} left alone, transformers does not support {pair.switch} for it"
                )
                continue
            claimed.add(id(module))
            done = True
            if before == pair.switch:
                state.note(
                    self.name,
                    f"{pair.name}: {label} already uses {pair.switch} attention (transformers' default), left alone",
                )
                continue
            module.set_attn_implementation(pair.switch)
            state.note(
                self.name,
                f"{pair.name}: {label} attention {before} -> {module.config._attn_implementation} via "
                "set_attn_implementation",
            )
        return done


def module_replace(pairs=None) -> ModuleReplace:
    """Swap modules for fused implementations: ``module_replace()`` tries every registered pair."""
    return ModuleReplace(pairs=pairs)

"""fp8: train chosen ``nn.Linear`` layers in float8, through transformer-engine or torchao.

Which Linear layers (ATorch's documented rules): weight dims both multiples of 16 (the fp8 GEMM and its
transpose in the backward need it), and the qualified name passes ``include`` (at least one
substring present, when given) and ``exclude`` (no substring present). The Llama example:
``exclude=("lm_head",)`` keeps the output head in high precision, which fp8 hurts.

Backends, chosen in ``resolve(env)``:

* ``transformer_engine`` on CUDA with compute capability >= 8.9 where it imports: ``te.Linear``
  with the weights copied, and ``fp8_autocast`` with ATorch's ``DelayedScaling`` recipe around
  the outer forward;
* ``torchao`` otherwise: ``convert_to_float8_training`` (dynamic per-tensor scaling, or the
  scaling ``recipe`` names: torchao's ``Float8LinearConfig.from_recipe_name``, "tensorwise",
  "rowwise" or "rowwise_with_gw_hp"). It runs on the CPU too (emulated: fp8 numerics, no
  speed-up), so the fp8 path trains in tests here. The DelayedScaling fields other than
  ``fp8_format`` have no torchao counterpart and are reported as unused.

Where neither can run the step is skipped with the reason (``strict=True``: RequirementError).
torchao's import takes seconds, so it is imported only when the step is applied.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from composable_atorch.core.contract import (
    AllOf,
    Contract,
    DeviceKind,
    MinComputeCapability,
    Order,
    Package,
    Stage,
    When,
)
from composable_atorch.core.transform import ApplyContext, TrainState, Transform
from composable_atorch.environment import Environment, quiet_imports
from composable_atorch.errors import ConfigError

BACKENDS = ("auto", "transformer_engine", "torchao")
#: torchao's scaling recipes (``Float8LinearConfig.from_recipe_name``); None: its default (tensorwise)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FORMATS = ("HYBRID", "E4M3")
AMAX_ALGOS = ("max", "most_recent")
#: ATorch's recipe.DelayedScaling fields and their defaults.
RECIPE_DEFAULTS = {
    "margin": 0,
    "interval": 1,
    "fp8_format": "HYBRID",
    "amax_history_len": 1024,
    "amax_compute_algo": "max",
    "reduce_amax": True,
}
_SHOWN = 40  # explain() lists at most this many modules per line


def _names(value, field: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        raise ConfigError(
            field, value, "None, a string or a list of non-empty strings (module-name substrings)"
        ) from None
    if not items or not all(isinstance(s, str) and s for s in items):
        raise ConfigError(field, value, "None, a string or a list of non-empty strings (module-name substrings)")
    return items


def _int(value, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"an integer >= {minimum}")
    return value


#: Hardware with fp8 tensor cores (torchao runs emulated anywhere else).
FP8_HARDWARE = AllOf(
    name="fp8 tensor cores", parts=(MinComputeCapability(major=8, minor=9), DeviceKind(kinds=("cuda",)))
)
#: What the transformer_engine backend needs, declared once: cuda + sm89 + the package importing.
TRANSFORMER_ENGINE = AllOf(
    name="transformer-engine",
    parts=(*FP8_HARDWARE.parts, Package(name="transformer_engine", extra="fp8")),
    on_unmet="skip",
)
TORCHAO = Package(name="torchao", extra="fp8", on_unmet="skip")


def _uses_te(t) -> bool:
    """backend='transformer_engine'"""
    return getattr(t, "backend", None) == "transformer_engine"


def _uses_torchao(t) -> bool:
    """backend='torchao'"""
    return getattr(t, "backend", None) == "torchao"


def te_usable(env: Environment) -> str | None:
    """What transformer-engine lacks here, or None when it can run (reads :data:`TRANSFORMER_ENGINE`)."""
    return TRANSFORMER_ENGINE.unmet(env, None)


def select_linears(model: nn.Module, include=None, exclude=None) -> tuple[list[str], list[tuple[str, str]]]:
    """The Linear layers fp8 swaps, and every other Linear with the reason it is kept.

    Rules in order: exact ``nn.Linear`` class, both weight dims multiples of 16, ``include``,
    ``exclude``.
    """
    chosen, kept = [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if type(module) is not nn.Linear:
            kept.append((name, f"{type(module).__name__} is not a plain nn.Linear"))
            continue
        out_f, in_f = module.weight.shape
        if out_f % 16 or in_f % 16:
            kept.append((name, f"weight {out_f}x{in_f}: dims not both multiples of 16"))
        elif include is not None and not any(s in name for s in include):
            kept.append((name, f"include: none of {list(include)} in its name"))
        elif exclude is not None and (hit := next((s for s in exclude if s in name), None)):
            kept.append((name, f"exclude: {hit!r} in its name"))
        else:
            chosen.append(name)
    return chosen, kept


def _listing(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


@dataclass(frozen=True)
class Fp8(Transform):
    """Float8 training of the chosen Linear layers (see the module docstring)."""

    name = "fp8"
    contract = Contract(
        stage=Stage.MODULE_REWRITE,
        orders=(
            Order(
                "module_replace",
                "module_replace may rebuild modules (and their Linear layers); fp8 swaps the final ones",
            ),
        ),
        roles=("fp8",),
        requires=(
            When(predicate=_uses_te, inner=TRANSFORMER_ENGINE, on_unmet="skip"),
            When(predicate=_uses_torchao, inner=TORCHAO, on_unmet="skip"),
        ),
    )

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    backend: str = "auto"
    margin: int = 0
    interval: int = 1
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    recipe: str | None = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("include", _names(self.include, "fp8.include"))
        set_("exclude", _names(self.exclude, "fp8.exclude"))
        if self.backend not in BACKENDS:
            raise ConfigError("fp8.backend", self.backend, ", ".join(repr(b) for b in BACKENDS))
        _int(self.margin, "fp8.margin", 0)
        _int(self.interval, "fp8.interval", 1)
        _int(self.amax_history_len, "fp8.amax_history_len", 1)
        fmt = self.fp8_format.upper() if isinstance(self.fp8_format, str) else self.fp8_format
        if fmt not in FORMATS:
            raise ConfigError("fp8.fp8_format", self.fp8_format, "'HYBRID' (e4m3 forward, e5m2 gradients) or 'E4M3'")
        set_("fp8_format", fmt)
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ConfigError("fp8.amax_compute_algo", self.amax_compute_algo, "'max' or 'most_recent'")
        if not isinstance(self.reduce_amax, bool):
            raise ConfigError("fp8.reduce_amax", self.reduce_amax, "True or False")
        if self.recipe is not None:
            if self.recipe not in RECIPES:
                raise ConfigError("fp8.recipe", self.recipe, "None or one of " + ", ".join(map(repr, RECIPES)))
            if self.backend == "transformer_engine":
                raise ConfigError(
                    "fp8.recipe", self.recipe, "None with backend='transformer_engine' (torchao's recipes need torchao)"
                )
            if fmt != "HYBRID":
                raise ConfigError(
                    "fp8.fp8_format", self.fp8_format, "'HYBRID' with a recipe (the recipe sets the casts)"
                )

    # -- search / ATorch ------------------------------------------------------------------------
    @classmethod
    def candidates(cls, search):
        """One candidate where fp8 can be faster: TE on sm89+, else torchao on fp8 hardware.

        Without fp8 tensor cores torchao only emulates (fp8 numerics at bf16 speed or worse: on this
        project's CPU one Linear's step was ~5x slower than fp32), so such a plan cannot win a
        speed search; a user who wants fp8 numerics there passes ``fp8(...)`` in the space's
        ``extra`` or in the plan itself."""
        env = search.env
        if te_usable(env) is None:
            return (cls(backend="transformer_engine", exclude=("lm_head",)),)
        if TORCHAO.unmet(env, None) is None and FP8_HARDWARE.unmet(env, None) is None:
            if search.on_paper:  # priced, not run: each of torchao's tensorwise and rowwise scaling
                return tuple(cls(backend="torchao", exclude=("lm_head",), recipe=r) for r in RECIPES[:2])
            return (cls(backend="torchao", exclude=("lm_head",)),)
        return ()

    @classmethod
    def from_seed(cls, config=None):
        """ATorch's dict: include, exclude, verbose (explain() always lists) and the recipe fields."""
        config = dict(config or {})
        config.pop("verbose", None)
        return fp8(**config)

    # -- environment --------------------------------------------------------------------------
    def resolve(self, env: Environment):
        te_missing = te_usable(env)
        if self.recipe is not None:  # a torchao recipe: torchao, and one whose torchao has it
            missing = _recipe_missing(self.recipe) if TORCHAO.unmet(env, self) is None else None
            if missing is not None:
                return None, missing
            if self.backend == "auto":
                return dataclasses.replace(self, backend="torchao").resolve(env)
        if self.backend in ("auto", "transformer_engine") and te_missing is None:
            return dataclasses.replace(self, backend="transformer_engine"), "backend transformer_engine (CUDA sm89+)"
        if self.backend == "transformer_engine":
            return None, f"the transformer_engine backend needs {te_missing}"
        if TORCHAO.unmet(env, self) is not None:
            why = "the torchao package" + (
                "" if self.backend == "torchao" else f", or for transformer_engine {te_missing}"
            )
            return (
                None,
                f"no fp8 backend can run: needs {why} (pip install 'composable_atorch[fp8]' -c constraints.txt)",
            )
        note = "backend torchao" + (
            "" if FP8_HARDWARE.unmet(env, self) is None else " (emulated on this device: fp8 numerics, no speed-up)"
        )
        if self.backend == "auto":
            note += f"; transformer_engine not used: needs {te_missing}"
        return dataclasses.replace(self, backend="torchao"), note

    def describe(self):
        if self.recipe is not None:
            rules = "".join(f"; {k}={list(v)}" for k, v in (("include", self.include), ("exclude", self.exclude)) if v)
            return f"fp8({self.backend}, {self.recipe}{rules})"
        rules = "".join(f"; {k}={list(v)}" for k, v in (("include", self.include), ("exclude", self.exclude)) if v)
        changed = {k: getattr(self, k) for k, d in RECIPE_DEFAULTS.items() if getattr(self, k) != d}
        recipe = "".join(f", {k}={v!r}" for k, v in changed.items())
        return f"fp8({self.backend}, {self.fp8_format}{recipe}{rules})"

    # -- application --------------------------------------------------------------------------
    def apply(self, state: TrainState, ctx: ApplyContext) -> TrainState:
        chosen, kept = select_linears(state.model, self.include, self.exclude)
        if self.backend == "transformer_engine":
            kind = self._apply_te(state, chosen)
        elif self.backend == "torchao":
            kind = self._apply_torchao(state, chosen, ctx.env)
        else:  # "auto" left unresolved: only when applied outside compose()
            raise ConfigError(
                "fp8.backend",
                self.backend,
                "a backend resolved by compose() (apply the plan, not the transform's apply())",
            )
        state.note(self.name, f"{len(chosen)} Linear -> {kind}: {_listing(chosen) or 'none'}")
        if kept:
            state.note(self.name, "not swapped: " + _listing([f"{n} ({why})" for n, why in kept]))
        return state

    def _apply_torchao(self, state: TrainState, chosen: list[str], env: Environment) -> str:
        with quiet_imports():  # torchao's loader lines about kernels this step does not call
            from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training

        # Without fp8 tensor cores, torchao's emulation (fp8 rounding, matmul in the high precision)
        # is the fast path: torch's own fp8 matmul on the CPU took 7.2 s for one 64 x 11008 Linear's
        # step against 50 ms emulated.
        emulate = FP8_HARDWARE.unmet(env, self) is not None
        kwargs = {"emulate": emulate}
        if self.fp8_format == "E4M3":  # torchao's default is HYBRID: e5m2 for gradients
            kwargs["cast_config_grad_output"] = CastConfig(target_dtype=torch.float8_e4m3fn)
        wanted = set(chosen)
        if wanted:
            config = Float8LinearConfig(**kwargs)
            if self.recipe is not None:
                config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=emulate)
            state.model = convert_to_float8_training(
                state.model, module_filter_fn=lambda m, fqn: fqn in wanted, config=config
            )
        unused = [
            f"{k}={getattr(self, k)!r}"
            for k in ("margin", "interval", "amax_history_len", "amax_compute_algo", "reduce_amax")
        ]
        state.note(
            self.name, f"torchao scales each tensor dynamically; DelayedScaling fields not used: {', '.join(unused)}"
        )
        return "torchao Float8Linear (same parameters" + (f", {self.recipe} scaling)" if self.recipe else ")")

    def recipe_kwargs(self, accepted: set[str], formats) -> dict:
        """ATorch's recipe as ``recipe.DelayedScaling`` keywords, limited to those it accepts.

        transformer-engine >= 1.8 dropped ``interval`` (scales update every step); passing it
        would raise, so fields the installed version does not accept are left out.
        """
        values = {k: getattr(self, k) for k in RECIPE_DEFAULTS}
        values["fp8_format"] = getattr(formats, self.fp8_format)
        return {k: v for k, v in values.items() if k in accepted}

    def _apply_te(self, state: TrainState, chosen: list[str]) -> str:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe

        model = state.model
        for name in chosen:
            old = model.get_submodule(name)
            new = te.Linear(
                old.in_features,
                old.out_features,
                bias=old.bias is not None,
                params_dtype=old.weight.dtype,
                device=old.weight.device,
            )
            with torch.no_grad():
                new.weight.copy_(old.weight)
                if old.bias is not None:
                    new.bias.copy_(old.bias)
            new.weight.requires_grad_(old.weight.requires_grad)
            if not name:  # the model is itself a Linear
                model = state.model = new
                continue
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
        accepted = set(inspect.signature(te_recipe.DelayedScaling).parameters)
        kwargs = self.recipe_kwargs(accepted, te_recipe.Format)
        fp8_recipe = te_recipe.DelayedScaling(**kwargs)
        dropped = sorted(set(RECIPE_DEFAULTS) - set(kwargs))
        if dropped:
            state.note(self.name, f"this transformer_engine's DelayedScaling has no {', '.join(dropped)}: not used")
        if chosen and getattr(model.forward, "_composable_atorch_fp8", None) is None:
            inner = model.forward

            @functools.wraps(inner)
            def forward(*args, **kwargs):
                with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                    return inner(*args, **kwargs)

            forward._composable_atorch_fp8 = fp8_recipe
            model.forward = forward
        return f"transformer_engine te.Linear (weights copied) under fp8_autocast(DelayedScaling {kwargs})"


def _recipe_missing(name: str) -> str | None:
    """Why the installed torchao cannot build ``name``'s config, or None."""
    from torchao.float8 import Float8LinearConfig

    if not hasattr(Float8LinearConfig, "from_recipe_name"):
        return "this torchao has no scaling recipes (Float8LinearConfig.from_recipe_name): upgrade torchao"
    try:
        Float8LinearConfig.from_recipe_name(name)
    except (ValueError, KeyError, AssertionError) as exc:
        return f"this torchao has no {name!r} recipe ({exc})"
    return None


def fp8(include=None, exclude=None, backend: str = "auto", recipe: str | None = None, **fields) -> Fp8:
    """Float8 Linear training: ``fp8(exclude=("lm_head",))``; ATorch's DelayedScaling fields (margin...),
    or torchao's scaling ``recipe`` ("tensorwise", "rowwise", "rowwise_with_gw_hp")."""
    unknown = sorted(set(fields) - set(RECIPE_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"fp8 recipe field {unknown[0]!r}", fields[unknown[0]], f"one of {', '.join(RECIPE_DEFAULTS)}"
        )
    return Fp8(include=include, exclude=exclude, backend=backend, recipe=recipe, **fields)

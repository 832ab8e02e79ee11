"""The optimizer side: rebuilding by parameter name, and one optimizer API for every plan.

One training loop serves every plan::

    optim.backward(loss); optim.step(); optim.zero_grad()

Transforms that need the loop (loss scaling, accumulation, clipping, skipping gradient sync, an
engine such as DeepSpeed's) contribute an :class:`OptimizerHook`; the :class:`PlanOptimizer`
runs the hooks in plan order. A plain ``loss.backward()`` stays correct where no hook scales the
loss.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from composable_atorch.errors import ParameterMappingError

#: Prefixes wrappers insert into parameter names; stripped to compare names across wrappers.
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_fpw_module.")


def canonical_name(name: str) -> str:
    """The parameter name with wrapper-inserted path components removed."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


#: Attribute a transform sets on a whole-model wrapper that prefixes every name (fairscale's
#: ShardedDataParallel, DeepSpeed's engine: ``"module."``), so names still map to the user's.
NAME_PREFIX_ATTR = "_composable_atorch_name_prefix"


def named_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    prefix = getattr(model, NAME_PREFIX_ATTR, "")
    return {canonical_name(n.removeprefix(prefix)): p for n, p in model.named_parameters()}


def parameter_names(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> dict[int, str]:
    """``id(param) -> canonical name`` for each parameter the optimizer holds.

    Raises ParameterMappingError when the optimizer holds a tensor the model does not own, or
    holds one parameter twice: either would make a rebuild by name lose or duplicate it.
    """
    if optim is None:
        return {}
    by_id = {id(p): n for n, p in named_parameters(model).items()}
    seen: dict[int, int] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    foreign = [f"tensor of shape {tuple(p.shape)}" for g in optim.param_groups for p in g["params"] if id(p) not in by_id]
    if foreign:
        raise ParameterMappingError("lose tensors the model does not own", foreign)
    dup = [by_id[i] for i, c in seen.items() if c > 1]
    if dup:
        raise ParameterMappingError("duplicate parameters listed more than once", dup)
    return {i: by_id[i] for i in seen}


def rebuild_optimizer(optim: torch.optim.Optimizer, names: dict[int, str], model: torch.nn.Module):
    """A new optimizer of the same class over ``model``'s parameters, matched by name.

    Every param group keeps its hyperparameters; the parameters of each group are the new model's
    parameters of the same names. Returns ``optim`` unchanged when it already holds exactly the
    model's parameters.
    """
    current = named_parameters(model)
    held = [p for g in optim.param_groups for p in g["params"]]
    if all(current.get(names.get(id(p), "")) is p for p in held):
        return optim
    if any(len(s) for s in optim.state.values()):
        raise ParameterMappingError(
            "drop optimizer state already accumulated for", [names.get(id(p), "?") for p in optim.state]
        )
    groups, missing = [], []
    for group in optim.param_groups:
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                # Already rebuilt once: the parameter object itself is current.
                name = next((n for n, q in current.items() if q is p), None)
            if name is None or name not in current:
                missing.append(name or f"<unnamed {tuple(p.shape)}>")
            else:
                params.append(current[name])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if missing:
        raise ParameterMappingError("lose parameters the transformed model no longer has", missing)
    # Constructor arguments are the defaults the constructor accepts (AdamW's defaults hold
    # 'decoupled_weight_decay', which its __init__ does not take); each group carries all of its
    # hyperparameters anyway, and the full defaults dict is restored afterwards.
    accepted = inspect.signature(type(optim).__init__).parameters
    new = type(optim)(groups, **{k: v for k, v in optim.defaults.items() if k in accepted})
    new.defaults = dict(optim.defaults)
    # keep the names map valid for the new parameter objects
    for name, p in current.items():
        names[id(p)] = name
    return new


class OptimizerHook:
    """One concern of the training loop; every method defaults to a no-op (as Fabric's Precision).

    Hooks run in plan order. ``accumulation_steps`` > 1 makes the optimizer step only every so
    many micro-batches.
    """

    accumulation_steps: int = 1
    #: True for a hook whose engine clips gradients itself (DeepSpeed's ``gradient_clipping``):
    #: clip_grad then adds no hook of its own, which would clip the engine's partitions locally.
    clips_gradients: bool = False

    def attach(self, optimizer: PlanOptimizer) -> None:
        """Called once when the plan's optimizer is built, for hooks that act outside it.

        DDP decides at *forward* time whether the coming backward all-reduces, so the hook that
        skips sync inside an accumulation window reads ``optimizer.is_boundary`` from a forward
        pre-hook.
        """

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def backward_context(self, is_boundary: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs) -> bool:
        """Run the backward pass itself (an engine's). Return True if done, False to let others."""
        return False

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def run_step(self, optimizer: torch.optim.Optimizer, closure=None) -> bool:
        """Perform the step itself (a grad scaler's). Return True if done, False to let others."""
        return False

    def after_step(self) -> None:
        pass

    def zero_grad(self, optimizer, set_to_none: bool) -> bool:
        """Zero gradients itself (an engine's). Return True if done."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PlanOptimizer(torch.optim.Optimizer):
    """The user's optimizer behind the plan's hooks. Quacks like the inner optimizer.

    It subclasses ``torch.optim.Optimizer`` (without re-initialising it) so LR schedulers accept
    it; ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, hooks: list[OptimizerHook]):  # noqa: D107
        self.optimizer = optimizer
        self.hooks = list(hooks)
        self.accumulation_steps = 1
        for h in self.hooks:
            self.accumulation_steps *= max(1, int(h.accumulation_steps))
        self.micro_step = 0  # micro-batches since the last real step
        self._forced_boundary: bool | None = None
        for h in self.hooks:
            h.attach(self)

    # -- delegation ----------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def __getattr__(self, item):
        if item == "optimizer":  # not yet set: avoid infinite recursion during unpickling
            raise AttributeError(item)
        return getattr(self.optimizer, item)

    def __repr__(self):
        return f"PlanOptimizer({self.optimizer!r}, hooks={[type(h).__name__ for h in self.hooks]})"

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def state_dict(self):
        return {
            "optimizer": self.optimizer.state_dict(),
            "hooks": [h.state_dict() for h in self.hooks],
            "micro_step": self.micro_step,
        }

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for h, s in zip(self.hooks, state_dict.get("hooks", []), strict=False):
            h.load_state_dict(s)
        self.micro_step = state_dict.get("micro_step", 0)

    # -- the loop ----------------------------------------------------------------------------
    @property
    def is_boundary(self) -> bool:
        """True when the current micro-batch ends an accumulation window (the step will step)."""
        if self._forced_boundary is not None:
            return self._forced_boundary
        return (self.micro_step + 1) % self.accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Seed compatibility: force (True/False) or clear (None) the boundary decision."""
        self._forced_boundary = is_boundary

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        for h in self.hooks:
            loss = h.scale_loss(loss)
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.backward_context(self.is_boundary))
            if not any(h.backward(loss, **kwargs) for h in self.hooks):
                loss.backward(**kwargs)

    def step(self, closure=None):
        boundary = self.is_boundary
        self.micro_step = 0 if boundary else self.micro_step + 1
        if not boundary:
            return None
        for h in self.hooks:
            h.before_step(self.optimizer)
        if not any(h.run_step(self.optimizer, closure) for h in self.hooks):
            self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        for h in self.hooks:
            h.after_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.micro_step != 0:  # inside an accumulation window: keep the sum
            return
        if not any(h.zero_grad(self.optimizer, set_to_none) for h in self.hooks):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def hook(self, kind: type) -> Iterator[OptimizerHook]:
        """The hooks of one type (e.g. the grad scaler), for inspection and tests."""
        return (h for h in self.hooks if isinstance(h, kind))

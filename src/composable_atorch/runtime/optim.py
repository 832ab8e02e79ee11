"""The optimizer side: rebuilding by parameter name, and one optimizer API for every plan.

One training loop serves every plan::

    optim.backward(loss); optim.step(); optim.zero_grad()

Transforms that need the loop (loss scaling, accumulation, clipping, skipping gradient sync, an
engine such as DeepSpeed's) contribute an :class:`OptimizerHook`; the :class:`PlanOptimizer`
runs the hooks in plan order. A plain ``loss.backward()`` stays correct where no hook scales the
loss; where one does, it is correct on a loss wrapped by ``optim.wrap_loss(loss)`` (or returned by a
loss function wrapped by ``optim.loss_wrapper(loss_func)``, ATorch's ``result.loss_func``), and a
step after an unwrapped one raises RequirementError instead of training wrongly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from composable_atorch.errors import ParameterMappingError, RequirementError

if TYPE_CHECKING:
    from composable_atorch.runtime.mesh import ParallelContext


class StepRunner(Protocol):
    """What a pipeline transform returns for ``train_step`` to drive: one forward and backward of a batch
    through its schedule, returning the step's mean loss."""

    def step(self, inputs: Any, targets: Any, loss_fn: Callable) -> float: ...


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
    foreign = [
        f"tensor of shape {tuple(p.shape)}" for g in optim.param_groups for p in g["params"] if id(p) not in by_id
    ]
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
    #: True for a hook whose ``scale_loss`` / ``backward`` must see every backward pass (loss
    #: scaling, accumulation averaging): after a plain ``loss.backward()`` the step would be wrong
    #: (unscaled by a scale never applied, or k times too large), so ``step()`` raises instead.
    needs_loss_hook: bool = False
    #: Set by a hook that skipped the last real optimizer step (inf/nan gradients).
    last_step_skipped: bool = False
    #: An error a hook found during the step; raised after every hook's ``after_step`` ran, so a
    #: hook that swapped something in for the step (master weights) has put it back first.
    pending_error: BaseException | None = None
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


class PlanLoss(torch.Tensor):
    """A loss whose ``backward()`` runs the plan optimizer's ``backward`` (made by :meth:`PlanOptimizer.wrap_loss`).

    So ATorch's loop ``loss = result.loss_func(input, output); loss.backward(); optim.step()``
    scales, averages and syncs as ``optim.backward(loss)`` does. Arithmetic on it gives plain
    tensors (``loss / 2`` is no longer hooked; a step after its plain backward raises if the plan
    needed the hook).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        optim = getattr(self, "_composable_atorch_optimizer", None)
        kwargs = {
            k: v
            for k, v in (("gradient", gradient), ("retain_graph", retain_graph), ("inputs", inputs))
            if v is not None
        }
        if create_graph:
            kwargs["create_graph"] = True
        if optim is None:
            return torch.Tensor.backward(self, **kwargs)
        return optim.backward(self, **kwargs)


class PlanOptimizer(torch.optim.Optimizer):
    """The user's optimizer behind the plan's hooks. Quacks like the inner optimizer.

    It subclasses ``torch.optim.Optimizer`` (without re-initialising it) so LR schedulers accept
    it; ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects.

    Two loops train every plan:

    * ``optim.backward(loss); optim.step(); optim.zero_grad()``;
    * ``loss = optim.wrap_loss(loss)`` (or a loss function wrapped by :meth:`loss_wrapper`), then
      the plain ``loss.backward(); optim.step(); optim.zero_grad()``.

    A bare ``loss.backward()`` on an unwrapped loss is fine where no hook needs the loss (bf16,
    fp32, clipping); where one does (the fp16 grad scaler, accumulation) ``step()`` raises
    RequirementError naming both fixes instead of stepping wrongly.

    What ATorch code reads from its returned optimizer:

    * ``optimizer`` — the wrapped torch optimizer (or engine's optimizer) the hooks drive;
    * ``grad_scaler`` — the ``torch.amp.GradScaler`` of an fp16 plan, else None;
    * ``step_was_skipped`` — True when the last real step was skipped (inf/nan gradients);
    * ``unscale_()`` — unscale now, before clipping by hand (the step then does not unscale again);
    * ``hooks`` — the plan's loop hooks in plan order (``hook(kind)`` filters them).

    What :func:`~composable_atorch.runtime.train_step.train_step` reads, typed, travels here too:
    ``parallel`` (the plan's :class:`~composable_atorch.runtime.mesh.ParallelContext`: the loss group,
    a sequence split's loss check) and ``runner`` (the pipeline runner the plan's pipeline step returned).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        hooks: list[OptimizerHook],
        *,
        parallel: ParallelContext | None = None,
        runner: StepRunner | None = None,
    ):  # noqa: D107
        self.optimizer = optimizer
        self.hooks = list(hooks)
        self.parallel = parallel
        self.runner = runner
        self.accumulation_steps = 1
        for h in self.hooks:
            self.accumulation_steps *= max(1, int(h.accumulation_steps))
        self.micro_step = 0  # micro-batches since the last real step
        self._forced_boundary: bool | None = None
        self._hooked_backwards = 0  # backward passes through the hooks since the last real step
        self._step_was_skipped = False
        #: Accelerate's name: whether the last backward synced gradients (its step changes the weights).
        #: Unlike ``is_boundary`` it keeps describing that micro-step after ``step()`` until the next backward.
        self.sync_gradients = True
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
        """ATorch compatibility: force (True/False) or clear (None) the boundary decision."""
        self._forced_boundary = is_boundary

    @property
    def grad_scaler(self):
        """The plan's ``torch.amp.GradScaler`` (fp16 loss scaling), or None (ATorch's ``optim.grad_scaler``)."""
        return next((h.scaler for h in self.hooks if getattr(h, "scaler", None) is not None), None)

    @property
    def step_was_skipped(self) -> bool:
        """True when the last real optimizer step was skipped for inf/nan gradients (ATorch's name)."""
        return self._step_was_skipped

    @property
    def needs_loss_hook(self) -> bool:
        """True when a plain ``loss.backward()`` on an unwrapped loss would train wrongly here."""
        return any(h.needs_loss_hook for h in self.hooks)

    def unscale_(self) -> None:
        """Unscale the gradients now, e.g. before clipping them by hand (ATorch's ``optim.unscale_()``).

        A no-op without a grad scaler; the next step does not unscale again.
        """
        for h in self.hooks:
            unscale = getattr(h, "unscale", None)
            if callable(unscale):
                unscale(self.optimizer)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as the hooks would back-propagate it (scaled, averaged over micro-batches).

        Counts as a hooked backward: ``optim.scale_loss(loss).backward()`` then steps correctly
        where no hook needs its own backward context (prefer :meth:`backward` or :meth:`wrap_loss`).
        """
        for h in self.hooks:
            loss = h.scale_loss(loss)
        self._hooked_backwards += 1
        return loss

    def wrap_loss(self, loss):
        """``loss`` (or the first element of a tuple/list of results) as a :class:`PlanLoss`:
        its plain ``.backward()`` runs ``self.backward(loss)``."""
        if isinstance(loss, list | tuple) and loss and isinstance(loss[0], torch.Tensor):
            return (
                type(loss)([self.wrap_loss(loss[0]), *loss[1:]])
                if isinstance(loss, list)
                else (self.wrap_loss(loss[0]), *loss[1:])
            )
        if not isinstance(loss, torch.Tensor):
            return loss
        wrapped = loss.as_subclass(PlanLoss)
        wrapped._composable_atorch_optimizer = self
        return wrapped

    def loss_wrapper(self, loss_func):
        """``loss_func`` whose returned loss back-propagates through the plan (ATorch's wrapped ``loss_func``).

        ``None`` stays None. Keeps the loss function's other return values (ATorch's loss
        functions may return ``(loss, extra...)``).
        """
        if loss_func is None:
            return None

        @functools.wraps(loss_func)
        def plan_loss_func(*args, **kwargs):
            return self.wrap_loss(loss_func(*args, **kwargs))

        return plan_loss_func

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if isinstance(loss, PlanLoss):
            loss = loss.as_subclass(torch.Tensor)  # a plain alias: its backward must not re-enter here
        loss = self.scale_loss(loss)
        self.sync_gradients = self.is_boundary
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.backward_context(self.is_boundary))
            if not any(h.backward(loss, **kwargs) for h in self.hooks):
                loss.backward(**kwargs)

    def _check_hooked(self) -> None:
        needing = [type(h).__name__ for h in self.hooks if h.needs_loss_hook]
        if not needing or self._hooked_backwards:
            return
        if not any(p.grad is not None for g in self.optimizer.param_groups for p in g["params"]):
            return
        raise RequirementError(
            "the plan's optimizer",
            f"every backward to go through it ({', '.join(needing)} scales or averages the loss); "
            "this step follows a plain loss.backward() of an unwrapped loss, which would train wrongly",
            "call optim.backward(loss) instead of loss.backward(), or wrap the loss first: "
            "loss = optim.wrap_loss(loss) (or loss_func = optim.loss_wrapper(loss_func)), then loss.backward()",
        )

    def step(self, closure=None):
        boundary = self.is_boundary
        self.micro_step = 0 if boundary else self.micro_step + 1
        if not boundary:
            return None
        self._check_hooked()
        self._hooked_backwards = 0
        for h in self.hooks:
            h.last_step_skipped = False
            h.before_step(self.optimizer)
        if not any(h.run_step(self.optimizer, closure) for h in self.hooks):
            self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        for h in self.hooks:
            h.after_step()
        self._step_was_skipped = any(h.last_step_skipped for h in self.hooks)
        for h in self.hooks:
            error, h.pending_error = h.pending_error, None
            if error is not None:
                raise error
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.micro_step != 0:  # inside an accumulation window: keep the sum
            return
        if not any(h.zero_grad(self.optimizer, set_to_none) for h in self.hooks):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def hook(self, kind: type) -> Iterator[OptimizerHook]:
        """The hooks of one type (e.g. the grad scaler), for inspection and tests."""
        return (h for h in self.hooks if isinstance(h, kind))

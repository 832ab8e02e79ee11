"""What every trial trains: the :class:`Workload` (factories, dataset, loss) the search is given,
the built-in one (:class:`GPTTask`), and what the search reads from its model and first batch
(:func:`model_facts`: the :class:`~composable_atorch.core.context.ModelFacts` the axes' candidates
decide their degrees on).

It lives apart from the per-rank worker (:mod:`.worker`) because the search, the preflight, the
predictor, the CLI and ATorch's facade all hold one without running a rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from composable_atorch.core.context import ForwardProfile, ModelFacts
from composable_atorch.data import TextDataset
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss


@dataclass(frozen=True)
class Workload:
    """What every trial trains. Everything here crosses a process boundary: module-level functions,
    classes or picklable objects only (no lambdas).

    ``model_fn()`` builds a fresh model; ``optim_fn(model)`` its optimizer (an optimizer class is
    called with ``model.parameters()``); ``loss_fn(model, batch)`` runs the forward and returns the
    loss of one batch; ``batch_size`` is the global batch (strong scaling).

    ``criterion(output, targets)``, when given, is the same loss in the shape of
    :func:`composable_atorch.train_step` for loaders that yield ``(inputs, targets)``: with it every
    plan trains through ``train_step(model, optim, inputs, targets, criterion)``, pipeline plans
    included (a pipeline runs the loss inside its schedule, on the last stage's output, so
    ``loss_fn(model, batch)`` cannot train one). Without it plans train through the same call on
    an adapter (:class:`WholeBatch`), and the search proposes no pipeline plan.
    """

    model_fn: Callable[[], Any]
    optim_fn: Callable[..., Any]
    dataset: Any
    loss_fn: Callable[[Any, Any], Any]
    batch_size: int
    loader_kwargs: dict = field(default_factory=dict)
    seed: int = 0
    criterion: Callable[[Any, Any], Any] | None = None

    def build(self):
        from torch.utils.data import DataLoader

        torch.manual_seed(self.seed)
        model = self.model_fn()
        optim = make_optimizer(self.optim_fn, model)
        kwargs = {"shuffle": True, "drop_last": True, **self.loader_kwargs}
        if kwargs.get("shuffle"):
            kwargs.setdefault("generator", torch.Generator().manual_seed(self.seed))
        loader = DataLoader(self.dataset, batch_size=self.batch_size, **kwargs)
        return model, optim, loader

    def check_picklable(self) -> None:
        """ConfigError naming the field that cannot reach a worker process (before any work).

        Called where a workload enters worker processes (:class:`~.trial.ProcessRunner`, which both the
        search and ATorch's dry run use), so a lambda fails here with its field's name, not inside spawn.
        """
        for name in ("model_fn", "optim_fn", "dataset", "loss_fn", "loader_kwargs", "criterion"):
            try:
                pickle.dumps(getattr(self, name))
            except Exception as exc:  # noqa: BLE001 - pickling can fail in many ways
                raise ConfigError(
                    name,
                    getattr(self, name),
                    f"a module-level function, class or picklable object: trials run in fresh processes ({exc})",
                ) from None


def make_optimizer(optim_fn, model):
    """``optim_fn(model)``, or an optimizer class called with ``model.parameters()``."""
    if isinstance(optim_fn, type) and issubclass(optim_fn, torch.optim.Optimizer):
        return optim_fn(model.parameters())
    return optim_fn(model)


@dataclass(frozen=True)
class GPTTask:
    """The built-in workload: the tiny GPT on the built-in corpus, as picklable factories.

    Used by the demo, the CLI's default task, the benchmark and the tests. A frozen dataclass whose
    bound methods pickle by reference, so trials in fresh processes rebuild exactly the same thing.
    """

    seq_len: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    lr: float = 3e-3
    batch_size: int = 16
    #: windows of the corpus to use (None: all of it)
    limit: int | None = None

    def model(self) -> GPT:
        return GPT(GPTConfig(seq_len=self.seq_len, d_model=self.d_model, n_layer=self.n_layer, n_head=self.n_head))

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)

    def dataset(self) -> TextDataset:
        return TextDataset(self.seq_len, limit=self.limit)

    @staticmethod
    def loss(model: torch.nn.Module, batch) -> torch.Tensor:
        tokens, targets = batch
        return lm_loss(model(tokens), targets)

    def workload(self, seed: int = 0) -> Workload:
        # criterion: the same loss on (output, targets), so pipeline plans train too (see Workload)
        return Workload(
            self.model, self.optimizer, self.dataset(), GPTTask.loss, self.batch_size, seed=seed, criterion=lm_loss
        )


def first_batch(workload: Workload):
    """The workload's first global batch, as its loader yields it (unshuffled)."""
    from torch.utils.data import DataLoader

    kwargs = {"drop_last": True, **workload.loader_kwargs, "shuffle": False}
    kwargs.pop("generator", None)
    return next(iter(DataLoader(workload.dataset, batch_size=workload.batch_size, **kwargs)))


def sequence_length(batch: Any) -> int | None:
    """The length of the batch's token sequences: dim 1 of its first tensor (``input_ids`` of a dict)."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    if isinstance(batch, list | tuple) and batch:
        batch = batch[0]
    return int(batch.size(1)) if isinstance(batch, torch.Tensor) and batch.dim() >= 2 else None


def profile(model: torch.nn.Module, batch: Any, loss_fn: Callable | None, criterion: Callable | None) -> ForwardProfile:
    """One forward (and loss) of ``model`` on the meta device over ``batch``: nothing is allocated."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    class Attention(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.heads: list[int] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention and args and hasattr(args[0], "shape"):
                self.heads.append(int(args[0].shape[1]) if args[0].dim() == 4 else 1)
            return func(*args, **(kwargs or {}))

    params = {id(p) for p in model.parameters()}
    saved = [0]

    def pack(t):
        if id(t) not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    try:
        meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
        mode = Attention()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            if loss_fn is not None:
                loss_fn(model, meta)
            elif criterion is not None and isinstance(meta, list | tuple) and len(meta) == 2:
                criterion(model(meta[0]), meta[1])
            else:
                model(meta)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run on meta: unknown, not an error
        return ForwardProfile(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])
    return ForwardProfile(saved[0], tuple(mode.heads))


def model_facts(model: torch.nn.Module, workload: Workload) -> tuple[ModelFacts | None, list[str]]:
    """What ``model`` (meta is fine) and the workload's first batch show, for the axes' candidates, and
    notes on what could not be read: none when the batch cannot be read here (the preflight names a
    broken dataset). The meta forward (:func:`profile`) runs only when an axis asks for it."""
    try:
        batch = first_batch(workload)
    except Exception as exc:  # noqa: BLE001 - the workload's own error is the preflight's to report
        return None, [f"parallel degrees not read: the first batch failed ({type(exc).__name__}: {exc})"]
    return (
        ModelFacts(
            model,
            sequence_length(batch),
            sum(p.numel() * p.element_size() for p in model.parameters()),
            lambda: profile(model, batch, workload.loss_fn, workload.criterion),
        ),
        [],
    )


def facts_notes(facts: ModelFacts | None) -> list[str]:
    """What the candidates' reading of ``facts`` could not tell: a meta forward that did not run."""
    seen = facts.profiled if facts is not None else None
    if seen is None or seen.error is None:
        return []
    return [f"the meta forward could not run ({seen.error}): activation share not measured"]


def block_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The model's repeated building blocks: user classes (not torch.nn's own) found at least twice.

    Outermost first, in the order the model holds them: GPT gives (Block, CausalSelfAttention, MLP).
    These are what checkpoint / fsdp-wrap / compile candidates are made of.
    """
    counts: dict[type, int] = {}
    for module in model.modules():
        cls = type(module)
        if cls.__module__.startswith("torch.") or module is model:
            continue
        if not any(True for _ in module.parameters()):
            continue
        counts[cls] = counts.get(cls, 0) + 1
    return tuple(cls for cls, n in counts.items() if n >= 2)


def example_model(model_fn):
    """The model, built on the meta device when it can be (no memory), to find its blocks."""
    try:
        with torch.device("meta"):
            return model_fn()
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; build them for real
        return model_fn()

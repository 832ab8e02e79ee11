"""The one harness every "equal to one process" test uses.

A distributed plan is right when it trains the model one plain process trains on the same global
batches: the same loss at every step and the same final parameters (gathered whole, under the
user's names), to fp32 reduction order. Every such test makes the same moves, each here once:

    OPTIMS = optimizers(sgd=dict(lr=0.5), adamw=dict(lr=1e-3))           # SGD and AdamW, both
    ref = reference(model, OPTIMS["adamw"](model.parameters()), batches, token_ce)  # plain torch
    # in each rank, after plan(model, optim, loader):
    losses, shapes = train(model, optim, loader, token_ce, steps)         # train_step, every plan
    run = {"params": plain(full_params(model)), "losses": losses, "shapes": shapes}
    assert_equal_to_one_process(runs, ref, atol=1e-4)                     # in the test, every rank

SGD and AdamW both: AdamW normalises each gradient, so a gradient off by a constant factor (a
missing 1/world) trains the same weights under it and only SGD shows the bug; SGD alone would
miss a wrong optimizer state. Results cross the process boundary as numpy arrays (:func:`plain`):
a torch tensor travels as a shared-memory handle of a rank that may already have exited.

Spawned worlds (``_dist.run_world``) start in a fraction of a second from a preloaded forkserver;
what costs is the plans' runs inside them. A reference is cheap next to them (2.5 s of
test_model_zoo's 67 s world, 66 references), but the parent computing them after the world runs on
one of the two cores: compute them in the world, split over the ranks (:func:`mine`), or once per
session (``functools.cache`` on the suite's reference).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

import composable_atorch as ca

# -- the optimizer table ---------------------------------------------------------------------------


def optimizers(sgd: dict, adamw: dict) -> dict[str, Callable]:
    """``{"sgd": params -> SGD(params, **sgd), "adamw": params -> AdamW(params, **adamw)}``."""
    return {"sgd": functools.partial(torch.optim.SGD, **sgd), "adamw": functools.partial(torch.optim.AdamW, **adamw)}


#: The settings the suites train with. AdamW's ``eps`` is raised above 1e-8 where a gradient is zero
#: in exact arithmetic (an attention key bias: softmax ignores a constant added to a row): its fp32
#: value is reduction-order noise near 1e-9, a different sum order at another world size, which
#: eps=1e-8 turns into full +-lr steps in whichever direction the noise points; eps 1e-6 moves it
#: by ~1e-6 and still normalises real gradients. SGD's rate is as large as the model trains stably
#: at, so a wrong gradient shows in the weights within the tolerance.
SEQUENCE = optimizers(sgd=dict(lr=0.5), adamw=dict(lr=1e-3))
PIPELINE = optimizers(sgd=dict(lr=0.5), adamw=dict(lr=1e-3, weight_decay=0.1))
ZOO = optimizers(sgd=dict(lr=0.05), adamw=dict(lr=1e-3, eps=1e-6))
EXPERT = optimizers(sgd=dict(lr=0.5), adamw=dict(lr=1e-2, eps=1e-6))
RESUME = optimizers(sgd=dict(lr=0.2), adamw=dict(lr=1e-2, eps=1e-4))
HYBRID = optimizers(sgd=dict(lr=0.1), adamw=dict(lr=1e-2))


# -- the loss functions ----------------------------------------------------------------------------


def logits_of(out) -> torch.Tensor:
    """A transformers output's logits, or the tensor a plain model returned."""
    return out.logits if hasattr(out, "logits") else out


def token_ce(out, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position against its own target (targets already shifted, or none needed)."""
    logits = logits_of(out)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def shifted_ce(out, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on token ids, as a transformers causal LM computes it from ``labels=ids``."""
    logits = logits_of(out)
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


class Logits(torch.nn.Module):
    """A transformers model as ``tokens -> logits`` (parameters shared), for a reference that trains it
    with the criterion a pipeline stage applies to the last stage's logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(input_ids=x).logits if hasattr(self.m, "config") else self.m(x)


# -- parameters ------------------------------------------------------------------------------------


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters under the user's names (wrapper prefixes removed), DTensor shards gathered whole:
    a collective under a sharding plan, so every rank calls it."""
    out = {}
    for name, p in ca.runtime.optim.named_parameters(model).items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's pieces: a DTensor's local shard, a whole tensor for a parameter kept whole."""
    return {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in ca.runtime.optim.named_parameters(model).items()
    }


def numpy_params(model: torch.nn.Module, *, remove_duplicate: bool = True) -> dict:
    """``model.named_parameters()`` as numpy copies (a pipeline stage: its own; a tied weight once
    unless ``remove_duplicate=False``)."""
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters(remove_duplicate=remove_duplicate)}


def plain(value):
    """Tensors -> numpy arrays, recursively, for the trip back from a rank."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def max_diff(a: dict, b: dict) -> float:
    """The largest elementwise gap between two name -> tensor (or array) maps of the same names."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(
        (float((torch.as_tensor(a[k]).float() - torch.as_tensor(b[k]).float()).abs().max()) for k in a), default=0.0
    )


def bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def loss_gap(a: Iterable[float], b: Iterable[float]) -> float:
    """The largest gap between two runs' step losses (of equal length)."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- one process, and a plan in each rank ----------------------------------------------------------


def reference(model, optim, batches, loss_fn, *, on_grads=None, scheduler=None) -> tuple[dict, list[float]]:
    """One process, no plan, plain torch: for each ``(inputs, targets)`` of ``batches``,
    ``loss_fn(model(inputs), targets)``, backward, ``on_grads(model)`` (clipping), step, zero_grad,
    ``scheduler.step()``. Returns ``(full_params, losses)``."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        if on_grads is not None:
            on_grads(model)
        optim.step()
        optim.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return full_params(model), losses


def train(model, optim, batches, loss_fn, steps: int | None = None) -> tuple[list[float], list[tuple]]:
    """``ca.train_step`` on the first ``steps`` batches (all of them for None): ``(losses, input shapes)``."""
    losses, shapes = [], []
    for x, y in itertools.islice(batches, steps):  # no batch read past the last step
        shapes.append(tuple(x.shape) if hasattr(x, "shape") else None)
        losses.append(ca.train_step(model, optim, x, y, loss_fn))
    return losses, shapes


# -- comparing -------------------------------------------------------------------------------------


def gaps(got: dict, ref: tuple[dict, list[float]]) -> tuple[float, float]:
    """``(parameter gap, loss gap)`` of one rank's :func:`run_plan` result to a :func:`reference`."""
    params, losses = ref
    return max_diff(got["params"], params), loss_gap(got["losses"], losses)


def assert_equal_to_one_process(runs, ref, atol: float, shape: tuple | None = None) -> None:
    """Every rank's run (``runs``) ends at the one-process ``ref``: weights and every step's loss
    within ``atol``; with ``shape``, its first batch had that shape on every rank."""
    for rank, got in enumerate(runs):
        if shape is not None:
            assert got["shapes"][0] == shape, (rank, got["shapes"][0], shape)
        dp, dl = gaps(got, ref)
        assert dp < atol and dl < atol, (rank, dp, dl)


def assert_stages_equal_to_one_process(runs, ref, atol: float) -> set:
    """Every rank's parameters (a pipeline stage holds its own) and losses at the one-process ``ref``;
    the ranks hold the whole model between them. Returns the names held."""
    params, losses = ref
    held = set()
    for rank, got in enumerate(runs):
        held |= set(got["params"])
        dp = max_diff(got["params"], {k: params[k] for k in got["params"]})
        dl = loss_gap(got["losses"], losses)
        assert dp < atol and dl < atol, (rank, dp, dl)
    assert held == set(params), sorted(set(params) ^ held)[:5]
    return held


def stage_gaps(stages, ref_losses, ref_params) -> tuple[float, float, bool, set]:
    """Pipeline stages against one process: ``stages`` is each rank's ``(losses, its stage's params)``.
    Returns ``(loss gap of the first rank, weight gap over every stage's params, whether every rank
    reported the same losses, the names the stages hold)``."""
    losses = [s[0] for s in stages]
    weight = max(float(abs(p - ref_params[n]).max()) for _, params in stages for n, p in params.items())
    held = {n for _, params in stages for n in params}
    return loss_gap(losses[0], ref_losses), weight, all(x == losses[0] for x in losses), held


# -- sharing the work of a world -------------------------------------------------------------------


def mine(rank: int, world: int, jobs: Iterable) -> list:
    """This rank's share of ``jobs`` (every ``world``-th, from ``rank``): one-process references
    computed inside a world, on every core, instead of in the parent after it."""
    return [job for i, job in enumerate(jobs) if i % world == rank]


def merged(per_rank: Iterable[dict]) -> dict:
    """The ranks' shares of :func:`mine` work, as one dict."""
    out: dict = {}
    for part in per_rank:
        out.update(part)
    return out

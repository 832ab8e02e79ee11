"""The sequence-split suite (context parallel, Ulysses): its models (tests/zoo/sequence.py) by name,
its text batches, and one training run of a plan compared with one process (tests/equivalence.py)
on the same global batches."""

from __future__ import annotations

import functools
import itertools

import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
import equivalence as eq
from composable_atorch.data import TextDataset
from composable_atorch.errors import ConfigError
from zoo.sequence import SEQ, block_lm, heads_from_width, llama, llama4, llama_mqa, user_lm

__all__ = ["llama", "user_lm"]

BATCH, STEPS = 4, 3

MODELS = {
    "user": user_lm,
    "llama": llama,
    "llama_mqa": llama_mqa,
    "llama4": llama4,
    "block_lm": block_lm,
    "heads_from_width": heads_from_width,
}

#: the loss of every case: each position against its own target (TextDataset's targets are shifted)
seq_loss = eq.token_ce


class Padded(TextDataset):
    """Targets of the last quarter ignored (-100): under context 2 they all fall in rank 0's part."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        y = y.clone()
        y[3 * SEQ // 4 :] = -100
        return x, y


def loader(batch: int = BATCH, padded: bool = False) -> DataLoader:
    return DataLoader((Padded if padded else TextDataset)(SEQ, limit=4 * BATCH), batch_size=batch)


def split(kind: str) -> tuple:
    """``(the mesh dimension, the transform)`` of a sequence split: all-gather context, the ring, Ulysses."""
    if kind == "context":
        return "context", ca.context_parallel()
    if kind == "ring":
        return "context", ca.context_parallel(rotation="ring")
    return "sequence", ca.sequence_parallel()


def make_optim(model, name: str):
    return eq.SEQUENCE[name](model.parameters())


@functools.cache
def reference(model_name: str, optim_name: str, steps: int = STEPS, padded: bool = False):
    """One process, no plan, the same global batches: ``(params, losses)`` (once per session)."""
    m = MODELS[model_name]()
    return eq.reference(m, make_optim(m, optim_name), itertools.islice(loader(padded=padded), steps), seq_loss)


def run(model_name: str, optim_name: str, *transforms, steps: int = STEPS, strategy=None, padded=False):
    """Apply the plan (or ATorch strategy list through load_strategy) and train ``steps`` steps."""
    m = MODELS[model_name]()
    plan = ca.strategy.load(strategy) if strategy is not None else ca.compose(*transforms)
    applied = plan(m, make_optim(m, optim_name), loader(padded=padded))
    m, opt, data = applied
    loss_fn = ca.sequence_cross_entropy(m) if padded else seq_loss
    losses, shapes = eq.train(m, opt, data, loss_fn, steps)
    return {"params": eq.plain(eq.full_params(m)), "losses": losses, "shapes": shapes, "explain": plan.explain(applied)}


def run_or_refusal(*args, **kwargs):
    """:func:`run`, or the ConfigError's message when the plan is refused."""
    try:
        return run(*args, **kwargs)
    except ConfigError as exc:
        return str(exc)


def check(results, key, model_name: str, optim_name: str, atol: float, shape=None, **reference_kw) -> dict:
    """Every rank's run ``results[rank][key]`` equals one process training ``model_name`` with
    ``optim_name`` (:func:`reference`); with ``shape``, each rank's first batch had it. Returns the last
    rank's run (for its explain)."""
    runs = [r[key] for r in results]
    eq.assert_equal_to_one_process(runs, reference(model_name, optim_name, **reference_kw), atol, shape=shape)
    return runs[-1]


def measured_peak(plan_json: str, task) -> int:
    """This rank's peak of one training step of ``plan_json`` on ``task`` (an auto.workload.GPTTask),
    measured as the trial worker measures (MemTracker after two warm-up steps, the batch fetched
    before the tracker starts), the batch taken through the plan's loader (a split shards it)."""
    from composable_atorch.auto.worker import peak_bytes_of_step, prefetch, trial_step

    torch.manual_seed(0)
    model = task.model()
    optim = task.optimizer(model)
    data_loader = DataLoader(task.dataset(), batch_size=task.batch_size)
    model, optim, data_loader = ca.Plan.from_json(plan_json)(model, optim, data_loader)
    data = iter([next(iter(data_loader))] * 3)
    for _ in range(2):
        trial_step(model, optim, data, task.loss, "cpu")
    fetched = prefetch(optim, data, "cpu")

    def step(before_micro=None):
        trial_step(model, optim, iter(fetched), task.loss, "cpu", before_micro)

    return peak_bytes_of_step(step, model, optim, "cpu")[0]

"""Losses under a sequence split (context parallel all-gather and ring, Ulysses) at world 2, sequence 64,
on a plain user model (tests/zoo/user.py's, no positions) and a tiny transformers Llama, SGD and AdamW.

Each rank holds chunks of every sequence and the gradient sync averages the ranks' losses, so only a
mean of per-token terms trains as one process. The three ways a user computes the loss:

* ``train_step(model, optim, x, y, loss_fn)``: a loss that shifts inside itself (the issue's
  ``out[:, :-1]`` against ``ids[:, 1:]``, with ``y = x`` or pre-shifted targets), a per-sequence
  maximum, a weight of the sequence length and a plain mean over padded targets are refused before
  any step (SequenceLossError, weights unchanged); a label-smoothed cross-entropy is not, and trains
  equal to one process;
* a transformers batch dict with ``labels=`` (the model shifts them itself): the loader's split turns
  them into ``shift_labels`` over the whole sequence and ``num_items_in_batch`` over the group, and
  3 steps equal one process (losses and weights); without that conversion they do not (the mutation
  is run here); a family that shifts by hand is refused;
* the user's own loop: a loss that slices the output along the sequence is refused at
  ``optim.backward``; with a plain ``loss.backward()``, targets equal to their inputs are refused at
  the step.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import _seq
import composable_atorch as ca
import equivalence as eq
from composable_atorch.data import TextDataset
from composable_atorch.errors import SequenceLossError
from composable_atorch.transforms.parallel.sequence import shard as shard_module
from composable_atorch.transforms.parallel.sequence.loss import graph_cuts
from composable_atorch.transforms.parallel.sequence.shard import targets_equal_inputs, with_shift_labels
from zoo.user import UserModel

from _dist import run_world

ATOL = 1e-5
V = 256  # TextDataset's bytes


def user(seed: int = 0) -> UserModel:
    torch.manual_seed(seed)
    return UserModel(vocab=V, d=32)


MODELS = {"user": user, "llama": _seq.llama}
MODES = {
    "allgather": lambda positions: (ca.parallel_mode([("context", 2)]), ca.context_parallel(positions=positions)),
    "ring": lambda positions: (
        ca.parallel_mode([("context", 2)]),
        ca.context_parallel(positions=positions, rotation="ring"),
    ),
    "ulysses": lambda positions: (ca.parallel_mode([("sequence", 2)]), ca.sequence_parallel(positions=positions)),
}
CASES = [(m, o) for m in MODELS for o in ("sgd", "adamw")]


# -- the losses -------------------------------------------------------------------------------------


def _logits(out):
    return getattr(out, "logits", out)


def shift_inside(out, ids):
    """The issue's loss: next-token cross-entropy with the shift inside."""
    return F.cross_entropy(_logits(out)[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def sequence_max(out, y):
    """The mean over the batch of each sequence's largest token loss: not a sum of per-token terms."""
    logits = _logits(out)
    tokens = F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1), reduction="none")
    return tokens.view(y.shape).amax(dim=1).mean()


def length_weighted(out, y):
    """A token mean weighted by the log of the sequence length the loss sees."""
    return _seq.seq_loss(out, y) * math.log(y.size(1))


def smoothed(out, y):
    """Label-smoothed cross-entropy: a mean of per-token terms, so not refused."""
    return F.cross_entropy(_logits(out).reshape(-1, V).float(), y.reshape(-1), label_smoothing=0.1)


class Labels(TextDataset):
    """transformers' habit: ``{"input_ids": x, "labels": x}``, the model shifts the labels itself."""

    def __getitem__(self, i):
        x, _ = super().__getitem__(i)
        return {"input_ids": x, "labels": x}


class SameTargets(TextDataset):
    """``(x, x)``: targets equal to the inputs, for a loss that shifts them."""

    def __getitem__(self, i):
        x, _ = super().__getitem__(i)
        return x, x


def _loader(dataset=TextDataset) -> DataLoader:
    return DataLoader(dataset(_seq.SEQ, limit=4 * _seq.BATCH), batch_size=_seq.BATCH)


def _llama_hand_shift():
    """A causal LM family that computes its loss by hand from ``labels`` (shifting them itself)."""
    from transformers import LlamaForCausalLM

    class HandShiftLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids)
            if labels is not None:
                out.loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
            return out

    torch.manual_seed(0)
    return HandShiftLlama(_seq.llama().config)


# -- the runs ---------------------------------------------------------------------------------------


def _apply(model_name, optim_name, mode, loader):
    model = MODELS[model_name]()
    optim = _seq.make_optim(model, optim_name)
    plan = ca.compose(*MODES[mode](model_name != "user"))
    applied = plan(model, optim, loader)
    return (*applied, plan.explain(applied))


def _refused(fn) -> str:
    try:
        fn()
    except SequenceLossError as exc:
        return f"SequenceLossError: {exc}"
    return "not refused"


def _params(model) -> dict:
    return {k: v.numpy() for k, v in eq.full_params(model).items()}


def _train_step_cases(model_name, optim_name, mode) -> dict:
    """(a) / (d) refused before any step, the weights unchanged; (e) then trains 3 steps."""
    model, optim, data, _ = _apply(model_name, optim_name, mode, _loader())
    x, y = next(iter(data))
    before = eq.full_params(model)
    out = {
        "issue": _refused(lambda: ca.train_step(model, optim, x, x, shift_inside)),
        "shifted_twice": _refused(lambda: ca.train_step(model, optim, x, y, shift_inside)),
        "sequence_max": _refused(lambda: ca.train_step(model, optim, x, y, sequence_max)),
        "length_weighted": _refused(lambda: ca.train_step(model, optim, x, y, length_weighted)),
    }
    out["unchanged"] = eq.max_diff(before, eq.full_params(model)) == 0.0
    losses = [ca.train_step(model, optim, x, y, smoothed) for _, (x, y) in zip(range(_seq.STEPS), data, strict=False)]
    out["smoothed"] = {"losses": losses, "params": _params(model)}
    return out


def _labels_run(optim_name, mode, convert: bool = True) -> dict:
    """(c) the own loop of a transformers user: ``out = model(**batch); optim.backward(out.loss)``."""
    model, optim, data, explain = _apply("llama", optim_name, mode, _loader(Labels))
    if not convert:  # the mutation: labels split as they are, the model shifts each part itself
        data.collate_fn.labels = True
        original, shard_module.with_shift_labels = shard_module.with_shift_labels, lambda batch, n: batch
    losses = []
    try:
        for _, batch in zip(range(_seq.STEPS), data, strict=False):
            loss = model(**batch).loss
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    finally:
        if not convert:
            shard_module.with_shift_labels = original
    return {"losses": losses, "params": _params(model), "explain": explain}


def _own_loop_cases(mode) -> dict:
    """The user's own loop on ``(x, x)`` batches with the shift inside the loss: through the plan's
    optimizer (the user model), and a plain ``loss.backward()`` (the Llama)."""
    out = {}
    for model_name, optim_name, key in (("user", "sgd", "optim_backward"), ("llama", "adamw", "plain_backward")):
        model, optim, data, _ = _apply(model_name, optim_name, mode, _loader(SameTargets))
        x, y = next(iter(data))
        before = eq.full_params(model)

        def step(model=model, optim=optim, x=x, y=y, plain=key == "plain_backward"):
            loss = shift_inside(model(x), y)
            loss.backward() if plain else optim.backward(loss)
            optim.step()

        out[key] = _refused(step)
        out[key + "_unchanged"] = eq.max_diff(before, eq.full_params(model)) == 0.0
    return out


def _world(rank, world, mode):
    out = {("steps", m, o): _train_step_cases(m, o, mode) for m, o in CASES}
    out.update({("labels", o): _labels_run(o, mode) for o in ("sgd", "adamw")})
    out.update(_own_loop_cases(mode))
    if mode == "allgather":
        out["labels_unconverted"] = _labels_run("sgd", mode, convert=False)
        model = _llama_hand_shift()
        plan = ca.compose(*MODES[mode](True))
        applied = plan(model, _seq.make_optim(model, "sgd"), _loader(Labels))
        out["hand_shift_explain"] = plan.explain(applied)
        out["hand_shift"] = _refused(lambda: next(iter(applied[2])))
        model, optim, data, _ = _apply("user", "adamw", mode, _seq.loader(padded=True))
        x, y = next(iter(data))
        out["padded_plain_mean"] = _refused(lambda: ca.train_step(model, optim, x, y, _seq.seq_loss))
    return out


@functools.cache
def _results(mode):
    return run_world(_world, 2, mode)


# -- one process ------------------------------------------------------------------------------------


@functools.cache
def _reference(model_name, optim_name, loss_name):
    model = MODELS[model_name]()
    optim = _seq.make_optim(model, optim_name)
    losses = []
    for _, batch in zip(range(_seq.STEPS), _loader(Labels if loss_name == "labels" else TextDataset), strict=False):
        loss = model(**batch).loss if loss_name == "labels" else smoothed(model(batch[0]), batch[1])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return eq.full_params(model), losses


# -- the tests --------------------------------------------------------------------------------------


def test_shift_labels_over_the_whole_sequence():
    ids = torch.arange(16).view(2, 8)
    batch = with_shift_labels({"input_ids": ids, "labels": ids}, 2)
    assert batch["shift_labels"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, -100]
    assert float(batch["num_items_in_batch"]) == 7.0  # 14 counted targets over 2 ranks
    given = with_shift_labels({"labels": ids, "num_items_in_batch": torch.tensor(30)}, 2)
    assert float(given["num_items_in_batch"]) == 15.0
    assert targets_equal_inputs((ids, ids.clone())) and not targets_equal_inputs((ids, ids + 1))
    assert not targets_equal_inputs({"input_ids": ids, "labels": ids})  # labels: shifted by the split itself


def test_graph_cuts_find_a_slice_of_the_sequence():
    logits = torch.randn(2, 8, 5, requires_grad=True)
    out = logits * 1.0
    node, shape = out.grad_fn, (2, 8, 5)
    reached, cuts = graph_cuts(
        F.cross_entropy(out[:, :-1].reshape(-1, 5), torch.zeros(14, dtype=torch.long)), node, shape
    )
    assert reached and cuts == ["[:, 0:7] (a slice of the sequence)"]
    assert graph_cuts(out[:, -1].sum(), node, shape)[1] == ["[:, -1] (one position)"]
    reached, cuts = graph_cuts(out[..., :3].float().sum() + out[:, :].sum(), node, shape)  # the class dim, whole slices
    assert reached and cuts == []
    assert graph_cuts((logits * 2).sum(), node, shape) == (False, [])  # a loss of something else


@pytest.mark.dist
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model_name,optim_name", CASES)
def test_loss_that_is_not_per_token_is_refused_before_any_step(mode, model_name, optim_name):
    for rank, got in enumerate(_results(mode)):
        case = got[("steps", model_name, optim_name)]
        for name in ("issue", "shifted_twice", "sequence_max", "length_weighted"):
            assert case[name].startswith("SequenceLossError"), (rank, name, case[name])
            assert "sequence_cross_entropy(model)" in case[name] and "targets[t] = inputs[t + 1]" in case[name]
        assert case["unchanged"], rank


@pytest.mark.dist
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model_name,optim_name", CASES)
def test_per_token_loss_is_not_refused_and_equals_one_process(mode, model_name, optim_name):
    runs = [got[("steps", model_name, optim_name)]["smoothed"] for got in _results(mode)]
    params, losses = _reference(model_name, optim_name, "smoothed")
    for rank, got in enumerate(runs):
        dp = eq.max_diff(got["params"], params)
        dl = max(abs(a - b) for a, b in zip(got["losses"], losses, strict=True))
        assert dp < 1e-4 and dl < 1e-4, (rank, dp, dl)


@pytest.mark.dist
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_transformers_labels_train_equal_to_one_process(mode, optim_name):
    runs = [got[("labels", optim_name)] for got in _results(mode)]
    params, losses = _reference("llama", optim_name, "labels")
    # each rank's loss is its part's summed token losses over 1/2 of the count: their mean is the whole's
    mean = [sum(r["losses"][i] for r in runs) / len(runs) for i in range(_seq.STEPS)]
    dl = max(abs(a - b) for a, b in zip(mean, losses, strict=True))
    dp = max(eq.max_diff(r["params"], params) for r in runs)
    assert dl < ATOL and dp < ATOL, (dl, dp)
    assert "labels are shifted over the whole sequence" in runs[0]["explain"]


@pytest.mark.dist
def test_transformers_labels_without_the_conversion_train_otherwise():
    runs = [got["labels_unconverted"] for got in _results("allgather")]
    params, losses = _reference("llama", "sgd", "labels")
    mean = [sum(r["losses"][i] for r in runs) / len(runs) for i in range(_seq.STEPS)]
    assert max(abs(a - b) for a, b in zip(mean, losses, strict=True)) > 100 * ATOL
    assert max(eq.max_diff(r["params"], params) for r in runs) > 100 * ATOL


@pytest.mark.dist
def test_a_family_that_shifts_labels_by_hand_is_refused():
    for got in _results("allgather"):
        assert got["hand_shift"].startswith("SequenceLossError") and "shift_labels" in got["hand_shift"]
        assert "does not compute its loss from shift_labels" in got["hand_shift_explain"]


@pytest.mark.dist
def test_a_plain_mean_over_padded_targets_is_refused():
    for got in _results("allgather"):
        assert got["padded_plain_mean"].startswith("SequenceLossError"), got["padded_plain_mean"]


@pytest.mark.dist
@pytest.mark.parametrize("mode", sorted(MODES))
def test_own_loop_shift_inside_is_refused_before_the_step(mode):
    for rank, got in enumerate(_results(mode)):
        assert got["optim_backward"].startswith("SequenceLossError"), (rank, got["optim_backward"])
        assert "cuts the model's output along the sequence ([:, 0:" in got["optim_backward"]
        assert got["plain_backward"].startswith("SequenceLossError"), (rank, got["plain_backward"])
        assert "targets equal their inputs" in got["plain_backward"]
        assert got["optim_backward_unchanged"] and got["plain_backward_unchanged"], rank

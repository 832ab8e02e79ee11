"""The stage check of pipeline_parallel runs each stage on probes shaped as training feeds it, so what a
stage cannot run is a typed StageMismatchError before any step, never a crash in training:

* both input forms: a padded batch dict (its mask carried) and a plain tensor (the model builds its own
  mask). DeBERTa-v2 builds a float mask when given none, which the stage's stand-in for the embeddings
  once passed on as their output: its relative positions were then built for the batch dimension and
  a later stage crashed in training (the old check ran the padded form only);
* the loader's sequence length: a user model whose later stage breaks at another length than the
  default probe's is refused by ``plan(model, optim, loader)`` on every rank of the pipeline.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import composable_atorch as ca
from composable_atorch.transforms.parallel.pipeline.anatomy import anatomy_of
from composable_atorch.transforms.parallel.pipeline.check import StageMismatchError, check_stage, references
from composable_atorch.transforms.parallel.pipeline.cutter import call_whole, cut_stage
from zoo import pipeline as zx

from _dist import run_world


def test_deberta_stages_are_checked_unpadded_too_and_the_cut_before_the_fix_is_refused():
    model = zx.encoder("deberta_v3")  # the config: buckets 8, max_relative_positions 16, shared key
    an = anatomy_of(model)
    refs = references(model, an, lambda m, x, **kw: call_whole(m, an, x, **kw))
    assert [tuple(r.example.shape) for r in refs] == [(2, zx.SEQ)] * 2
    assert [r.mask is not None for r in refs] == [True, False]  # padded, then as a plain tensor
    stage = cut_stage(copy.deepcopy(model), an, False, True, range(1, 2), lambda m: None)
    layer = {1: stage.deberta.encoder.layer[1]}
    for ref in refs:
        check_stage(stage, 1, layer, False, ref, an.carry, last=True)
    # the cut before the fix: the embeddings' stand-in passed on its first floating-point input, the float
    # mask the model builds when given none; the padded probe (a long mask), all the old check ran, passes
    stage.deberta.embeddings.received = None
    check_stage(stage, 1, layer, False, refs[0], an.carry, last=True)
    with pytest.raises(
        StageMismatchError,
        match=r"stage 1 fails in block 1 \(DebertaV2Layer\) on a probe of \(2, 16\) the whole model runs "
        r"\(RuntimeError: The expanded size",
    ):
        check_stage(stage, 1, layer, False, refs[1], an.carry, last=True)


class _IdsPositions(nn.Module):
    """A user model written for token ids: its sinusoidal positions (a buffer) are cut to ``x.shape[-1]``,
    the ids' length. A later stage is called with the hidden states, whose last dimension is the width:
    the positions it cuts add to its (discarded) embeddings only at a length equal to the width, 16."""

    def __init__(self, width: int = 16, longest: int = 64):
        super().__init__()
        self.embed = nn.Embedding(zx.VOCAB, width)
        angle = torch.arange(longest)[:, None] / 10000 ** (torch.arange(width)[None] / width)
        self.register_buffer("positions", torch.where(torch.arange(width) % 2 == 0, angle.sin(), angle.cos()))
        self.blocks = nn.ModuleList(zx.Block(width) for _ in range(2))
        self.head = nn.Linear(width, zx.VOCAB)

    def forward(self, x):
        h = self.embed(x) + self.positions[: x.shape[-1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


LONG = 32  #: the loader's sequence length, not the width


def _model():
    torch.manual_seed(0)
    return _IdsPositions()


def _plan(with_loader: bool):
    model = _model()
    ids = torch.randint(1, zx.VOCAB, (8, LONG), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids), batch_size=4) if with_loader else None
    plan = ca.compose(ca.pipeline_parallel(microbatches=2), ca.parallel_mode([("pipeline", 2)]))
    try:
        applied = plan(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    except StageMismatchError as exc:
        return str(exc)
    return plan.explain(applied=applied)


def _world(rank, world):
    return _plan(with_loader=True), _plan(with_loader=False)


@pytest.mark.dist
def test_a_stage_that_breaks_only_at_the_loaders_length_is_refused_on_every_rank_before_any_step():
    with torch.no_grad():  # one process runs the model at that length: the cut breaks it, not the model
        assert _model()(torch.ones(2, LONG, dtype=torch.long)).shape == (2, LONG, zx.VOCAB)
    (with0, without0), (with1, without1) = run_world(_world, 2, timeout=300)
    for said in (with0, with1):  # stage 1 fails on rank 1; rank 0 refuses with it rather than wait on it
        assert "stage 1 fails before its first block 1 (in the forward around the blocks)" in said, said
        assert f"on a probe of (2, {LONG}) the whole model runs (RuntimeError" in said, said
    # without a loader the probe has the default length, 16: that is all the check can run then
    for explain in (without0, without1):
        assert "probes of (2, 16)" in explain, explain


def _pipeline_checkpoint_case(rank, world, cases):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import _seq

    out = {}
    for optim_name, policy in cases:
        run = _seq.run(
            "llama",
            optim_name,
            ca.parallel_mode([("pipeline", 2)]),
            ca.pipeline_parallel(microbatches=2),
            ca.checkpoint(LlamaDecoderLayer, policy=policy),
        )
        out[(optim_name, policy)] = run["losses"]
    return out


@pytest.mark.dist
def test_checkpointed_transformers_stages_train_equal_to_one_process():
    """A checkpointed layer at the start of a later stage: its recompute in the backward replays the stage's
    input hook after the stage's forward returned (the input it would put back is gone), which crashed with
    ``'NoneType' object has no attribute 'dtype'`` in the first step; the recompute keeps its saved inputs."""
    import _seq

    cases = [("sgd", "full"), ("adamw", "full"), ("sgd", "selective")]
    results = run_world(_pipeline_checkpoint_case, 2, cases)
    for optim_name, policy in cases:
        _, want = _seq.reference("llama", optim_name)
        for got in results:  # the loss train_step reports is the same on both stages
            assert max(abs(a - b) for a, b in zip(got[(optim_name, policy)], want, strict=True)) < 1e-5

"""pipeline_parallel on models that choose each layer's attention by its index (``config.layer_types[i]``):
Gemma 2, GPT-OSS, Cohere 2, Gemma 3, Qwen2 with sliding layers, built as users build them (defaults
on, ``use_cache`` included; window 4 at sequence 16). Each trains at world 2 equal to one process
(SGD and AdamW); and the per-layer check refuses a stage that would run a block on other inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import composable_atorch as ca
import equivalence as eq
from composable_atorch.transforms.parallel.pipeline.anatomy import anatomy_of
from composable_atorch.transforms.parallel.pipeline.check import StageMismatchError, check_stage, reference
from composable_atorch.transforms.parallel.pipeline.cutter import Absent, call_whole, cut_stage
from zoo import pipeline as zx

from _dist import run_world

STEPS, TOL = 3, 1e-4
OPTIMS = eq.PIPELINE


def _run(name, opt, pipelined):
    model = zx.build(name).eval()  # dropout off: both runs compute the same function
    data = [zx.batch(s) for s in range(STEPS)]
    if not pipelined:
        optim = OPTIMS[opt](model.parameters())
        losses = [ca.train_step(eq.Logits(model), optim, x, x, eq.shifted_ce) for x in data]
        return losses, eq.numpy_params(model, remove_duplicate=False), ""
    plan = ca.compose(ca.pipeline_parallel(microbatches=2), ca.parallel_mode([("pipeline", 2)]))
    applied = plan(model, OPTIMS[opt](model.parameters()))
    model, optim, _ = applied
    losses = [ca.train_step(model, optim, x, x, eq.shifted_ce) for x in data]
    return losses, eq.numpy_params(model, remove_duplicate=False), plan.explain(applied=applied)


def _world(rank, world):
    jobs = [(n, o) for n in zx.LAYER_TYPED for o in OPTIMS]
    mine = {f"{n}/{o}": _run(n, o, True) for n, o in jobs}
    refs = {f"{n}/{o}": _run(n, o, False) for n, o in eq.mine(rank, world, jobs)}
    return mine, refs


@pytest.mark.dist
def test_layer_typed_models_pipeline_equal_to_one_process():
    (r0, refs0), (r1, refs1) = run_world(_world, 2, timeout=900)
    bad = {}
    for case, (ref_losses, ref_params, _) in {**refs0, **refs1}.items():
        gap, weight, same, held = eq.stage_gaps([r0[case][:2], r1[case][:2]], ref_losses, ref_params)
        if not same or gap > TOL or weight > TOL or not held <= set(ref_params):
            bad[case] = (gap, weight, same)
        explain = r0[case][2]
        assert "each stage's blocks see the whole model's inputs" in explain, explain
    assert not bad, bad


def _stages(model, cuts):
    """Every stage of ``model`` cut in one process (deep copies), with the whole model's reference."""
    an = anatomy_of(model)
    ref = reference(model, an, lambda m, x, **kw: call_whole(m, an, x, **kw))
    bounds = (0, *cuts, len(an.blocks))
    out = []
    for s in range(len(bounds) - 1):
        stage = cut_stage(
            copy.deepcopy(model), an, s == 0, s == len(bounds) - 2, range(bounds[s], bounds[s + 1]), lambda m: None
        )
        out.append((s, stage, range(bounds[s], bounds[s + 1])))
    return an, ref, out


def test_the_check_passes_the_fixed_cut_and_refuses_a_position_indexed_one():
    model = zx.build("gemma2")
    an, ref, stages = _stages(model, (1,))
    assert ref.example.shape[1] > zx.WINDOW  # the probe is longer than the window: sliding and full masks differ
    assert ref.mask is not None and not ref.mask.all()  # and padded: the mask travels between stages
    for s, stage, held in stages:
        layers = stage.model.layers
        check_stage(stage, s, {i: layers[i] for i in held}, s == 0, ref, an.carry, last=s == 1)
    # the cut before the fix: the list held this stage's layers only, so the loop's index was the stage's
    s, stage, held = stages[1]
    layers = stage.model.layers
    for key in [k for k, m in layers._modules.items() if isinstance(m, Absent)]:
        del layers._modules[key]
    with pytest.raises(StageMismatchError, match="padded, stage 1's block 1: its input.*attention_mask"):
        check_stage(stage, s, {1: layers._modules["1"]}, False, ref, an.carry)


class _PadMasked(nn.Module):
    """A user model that builds its padding mask from the token ids in its forward and gives it to every
    block: a later stage, called with the hidden states, would build another mask."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(zx.VOCAB, 16)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(2))
        self.head = nn.Linear(16, zx.VOCAB)

    def forward(self, x):
        keep = (x != 0).float() if x.dim() == 2 else torch.ones(x.shape[:2])
        h = self.embed(x)
        for b in self.blocks:
            h = b(h, keep)
        return self.head(h)


class _MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h, keep):
        return h + self.lin(h) * keep.unsqueeze(-1)


def test_the_check_refuses_a_forward_that_depends_on_the_first_stages_input():
    torch.manual_seed(0)
    model = _PadMasked()
    an, ref, stages = _stages(model, (1,))
    ref = reference(model, an, lambda m, x: m(torch.where(torch.arange(x.shape[1]) < 3, 0, x)))  # 3 pads
    s, stage, held = stages[1]
    with pytest.raises(StageMismatchError, match="positional input.*other values"):
        check_stage(stage, s, {1: stage.blocks[1]}, False, ref)


def test_the_check_refuses_a_stage_that_drops_the_attention_mask():
    model = zx.encoder("bert")
    an, ref, stages = _stages(model, (1,))
    s, stage, held = stages[1]
    layer = stage.bert.encoder.layer
    check_stage(stage, s, {1: layer[1]}, False, ref, an.carry)  # carried: equal to the whole model
    with pytest.raises(
        StageMismatchError, match=r"block 1: its positional input\[0\] is None on the stage, a .* bool tensor"
    ):
        check_stage(stage, s, {1: layer[1]}, False, ref)  # not carried: the stage attends to the pads


class _FunctionalTie(nn.Module):
    """A user model whose head reuses the embedding's weight functionally: the last stage lacks it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(zx.VOCAB, 16)
        self.blocks = nn.ModuleList(zx.Block(16) for _ in range(2))

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.linear(h, self.embed.weight)


def test_a_last_stage_that_needs_another_stages_weight_is_a_typed_refusal():
    torch.manual_seed(0)
    an, ref, stages = _stages(_FunctionalTie(), (1,))
    s, stage, held = stages[1]
    with pytest.raises(StageMismatchError, match=r"the last stage \(stage 1\) returns another output"):
        check_stage(stage, s, {1: stage.blocks[1]}, False, ref, last=True)

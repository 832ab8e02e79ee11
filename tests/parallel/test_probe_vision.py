"""ddp's unused-parameter probe on models that take images (ViT, ConvNeXt, a user CNN on pixel tensors).

The probe used to feed token ids to every model: a vision model failed its probe forward, was never
probed, and a classifier branch its forward does not use stopped torch's reducer at the second step
("Expected to have finished reduction"). The example input is now guessed in one place
(composable_atorch.transforms.example_input, shared with the tensor-parallel planner): images for
vision models, so the spare branch is found and find_unused_parameters turned on. A model whose input
cannot be guessed is said in explain() to be not probed; it is never a crash.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import composable_atorch as ca
import equivalence as eq
import zoo
from composable_atorch.transforms import example_input
from composable_atorch.transforms.parallel.shared import probe
from composable_atorch.transforms.parallel.tensor import graph

from _dist import run_world

STEPS = 3
VISION = ("vit", "convnext", "cnn")
OPTIMS = eq.ZOO


def _spare(name: str) -> nn.Module:
    """The zoo's vision model with an extra classifier branch its forward never calls (as a user adds an
    auxiliary head used only at evaluation)."""
    model = zoo.build(name)
    model.spare_classifier = nn.Linear(8, zoo.CLASSES)
    return model


class DictInput(nn.Module):
    """A user model that takes its batch as a dict: no guessed input fits its forward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2))

    def forward(self, batch: dict):
        if not isinstance(batch, dict):
            raise TypeError(f"DictInput takes a dict batch, not {type(batch).__name__}")
        return self.net(batch["features"])


class NoLayers(nn.Module):
    """A model with no layer the guess knows (no Embedding, Conv2d or Linear): nothing to build an input from."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(6, 2))

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("name", VISION)
def test_vision_models_are_probed_with_images(name):
    args, kwargs = example_input.example_input(zoo.build(name))
    image = kwargs.get("pixel_values", args[0] if args else None)
    assert image is not None and image.dim() == 4 and image.shape[1] == 3
    assert probe.probe_unused(zoo.build(name)).unused == []  # probed, every parameter used
    assert sorted(probe.probe_unused(_spare(name)).unused) == ["spare_classifier.bias", "spare_classifier.weight"]


def test_one_guess_serves_ddp_and_the_tensor_planner():
    assert graph.example_input is probe.example_input is example_input.example_input
    _, kwargs = example_input.example_input(zoo.build("clip"))
    assert set(kwargs) == {"input_ids", "pixel_values"}  # a two-tower model gets text and an image
    assert probe.probe_unused(zoo.build("clip")).unused is not None


def test_an_input_that_cannot_be_built_is_a_reason_not_a_crash():
    dict_input = probe.probe_unused(DictInput())
    assert dict_input.unused is None and "failed" in dict_input.reason
    no_layers = probe.probe_unused(NoLayers())
    assert no_layers.unused is None and "no example input" in no_layers.reason


def test_a_model_over_the_probe_limit_is_said_to_be_not_probed(monkeypatch):
    from types import SimpleNamespace

    from composable_atorch.transforms.parallel.data import data_parallel

    notes = []
    state = SimpleNamespace(model=_spare("cnn"), note=lambda name, text: notes.append((name, text)))
    assert data_parallel._probe_unused(state) and "spare_classifier.weight" in notes[-1][1]
    monkeypatch.setattr(data_parallel, "PROBE_LIMIT", 1000)
    assert not data_parallel._probe_unused(state)
    assert "not probed for unused parameters" in notes[-1][1] and "over the probe's" in notes[-1][1]


def _loss(name, model, data):
    if name == "dict":
        return nn.functional.mse_loss(model(data), data["target"])
    return zoo.zoo_loss(name, model, data)


def _batches(name):
    if name != "dict":
        return [zoo.batch(name, seed=s) for s in range(STEPS)]
    g = torch.Generator().manual_seed(7)
    return [
        {"features": torch.randn(4, 6, generator=g), "target": torch.randn(4, 2, generator=g)} for _ in range(STEPS)
    ]


def _model(name):
    torch.manual_seed(0)
    return DictInput() if name == "dict" else _spare(name)


def _train(name, model, optim, rows):
    for data in _batches(name):
        loss = _loss(name, model, zoo.part(data, rows))
        optim.backward(loss) if hasattr(optim, "backward") else loss.backward()
        optim.step()
        optim.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _world(rank, world, cases):
    out = {}
    for name, opt in cases:
        model = _model(name)
        plan = ca.compose(ca.ddp())
        applied = plan(model, OPTIMS[opt](model.parameters()))
        params = _train(name, applied[0], applied[1], slice(2 * rank, 2 * rank + 2))
        out[(name, opt)] = (plan.explain(applied=applied), {k: v.numpy() for k, v in params.items()})
    return out


@pytest.mark.dist
def test_ddp_on_vision_models_with_a_spare_branch_matches_one_process():
    """World 2, each rank on its half of the global batch, against one process on the whole batch."""
    cases = [(n, o) for n in (*VISION, "dict") for o in OPTIMS]
    results = run_world(_world, 2, cases, timeout=600)
    for name, opt in cases:
        model = _model(name)
        ref = _train(name, model, OPTIMS[opt](model.parameters()), slice(None))
        (explain, p0), (_, p1) = results[0][(name, opt)], results[1][(name, opt)]
        if name == "dict":
            assert "not probed for unused parameters" in explain and "find_unused_parameters stays off" in explain
        else:
            assert "spare_classifier.weight" in explain and "find_unused_parameters turned on" in explain
        assert set(p0) == set(ref)
        gap = max(float((torch.from_numpy(p0[k]) - ref[k]).abs().max()) for k in ref)
        ranks = max(float(abs(p0[k] - p1[k]).max()) for k in ref)
        moved = max(float((ref[k] - _model(name).get_parameter(k)).abs().max()) for k in ref)
        assert gap < 1e-4 and ranks == 0 and moved > 0, (name, opt, gap, ranks, moved)

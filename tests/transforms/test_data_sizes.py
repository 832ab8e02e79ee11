"""Tiny and empty datasets are typed errors before any work; DistributedSampler's padding is explained."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import composable_atorch as ca
from composable_atorch.errors import DatasetSizeError

from _dist import run_world
from helpers import gpt


def loader_of(samples: int, batch: int, **kwargs) -> DataLoader:
    x = torch.randint(0, 64, (samples, 8))
    return DataLoader(TensorDataset(x, x), batch_size=batch, **kwargs)


PLANS = {
    "plain": lambda: ca.compose(),
    "amp": lambda: ca.amp("bf16"),
    "accumulate": lambda: ca.accumulate(2),
    "checkpoint": lambda: ca.compose(ca.checkpoint(torch.nn.Linear), ca.clip_grad(1.0)),
}


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("samples, drop_last", [(0, False), (3, False), (3, True)])
def test_a_dataset_smaller_than_one_global_batch_is_a_typed_error(name, samples, drop_last):
    model = gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(DatasetSizeError) as err:
        PLANS[name]()(model, torch.optim.SGD(model.parameters(), lr=0.1), loader_of(samples, 4, drop_last=drop_last))
    assert (err.value.samples, err.value.global_batch) == (samples, 4)
    assert ("is empty" if samples == 0 else "holds 3 sample(s), fewer than one global batch of 4") in str(err.value)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_one_global_batch_is_enough_and_iterable_datasets_are_not_counted():
    model = gpt()
    ca.compose()(model, torch.optim.SGD(model.parameters(), lr=0.1), loader_of(4, 4))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    ca.compose()(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(Stream(), batch_size=4))


def world2_sizes(rank, world):
    out = {}
    for samples, drop_last in ((9, False), (9, True), (8, False)):
        model, plan = gpt(), ca.compose(ca.ddp())
        applied = plan(model, torch.optim.SGD(model.parameters(), lr=0.1), loader_of(samples, 4, drop_last=drop_last))
        out[(samples, drop_last)] = plan.explain(applied=applied)
    try:
        model = gpt()
        ca.ddp()(model, torch.optim.SGD(model.parameters(), lr=0.1), loader_of(3, 4))
    except DatasetSizeError as exc:
        out["small"] = str(exc)
    return out


@pytest.mark.dist
def test_world2_padding_is_explained_and_a_small_dataset_fails_on_every_rank():
    for out in run_world(world2_sizes, 2):
        assert "pads 9 samples with 1 repeat(s) of the first so they divide over 2 ranks" in out[(9, False)]
        assert "drops the last 1 of 9 samples" in out[(9, True)]
        assert "pads" not in out[(8, False)] and "drops" not in out[(8, False)]
        assert "fewer than one global batch of 4" in out["small"]

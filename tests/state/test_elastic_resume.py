"""Resuming at another world size or layout: every sample once per epoch, the uninterrupted run's math.

The same plan expression is applied at each world (the data size refits), a run saves mid-epoch
and a new process group of another size loads it and continues. Each step's global batch (the
sample ids every rank read), its loss and the final weights are compared with one process training
on the run's global order (the DistributedSampler's permutation of seed 0 and the epoch, read 12
at a time): sample sets exactly, losses and weights to fp32 reduction order. SGD and AdamW, under
an LR scheduler saved and restored with the run.

Groups (spawned in this order; each batches every case that runs at its size):
world 4 (fsdp with and without accumulate(2), tensor 2 x data 2 + fsdp, pipeline 2 x data 2: steps
1-3) -> world 3 (fsdp: 4-6; the global batch 8 refused; a failed load changes nothing) -> world 2
(tensor 2 x data 1 and pipeline 2 x data 1: 4-8; ddp: 1-3; pipeline 1 x data 2 syncs gradients) ->
world 4 (fsdp: 7-8; ddp: 4-8).
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import composable_atorch as ca
import equivalence as eq
from _resharding import Indexed, reference_run
from _resharding import global_order as global_order_of
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.runtime.layout import nearest_model_degrees, plan_layout
from composable_atorch.runtime.loader import check_global_batch, fitting_worlds
from composable_atorch.runtime.resumable import resumable

from _dist import run_world

SEQ, SAMPLES, BATCH, TOTAL = 8, 48, 12, 8  # 4 steps per epoch; the run crosses into epoch 1
OPTIMIZERS = eq.RESUME  # AdamW's eps above rounding noise: see equivalence.py
PLANS = {
    "fsdp": lambda: ca.compose(ca.fsdp(wrap=(Block,))),
    "tp_fsdp": lambda: ca.compose(
        ca.tensor_parallel(), ca.fsdp(wrap=(Block,)), ca.parallel_mode([("tensor", 2), ("data", 2)])
    ),
    "pp": lambda: ca.compose(ca.pipeline_parallel(microbatches=2), ca.parallel_mode([("pipeline", 2), ("data", 2)])),
    "ddp": lambda: ca.compose(ca.ddp()),
    # accumulate(2): at data 4 the share of 3 refits to 3 micro-batches of 1, at data 3 it is 2 of 2,
    # so the saved position (in loader batches) differs per world and resumes from global samples
    "fsdp_acc": lambda: ca.compose(ca.fsdp(wrap=(Block,)), ca.accumulate(2)),
}
#: case -> [(world, first step, last step)]: each phase saves at its last step, the next loads it
PHASES = {
    "fsdp": [(4, 1, 3), (3, 4, 6), (4, 7, 8)],
    "tp_fsdp": [(4, 1, 3), (2, 4, 8)],
    "pp": [(4, 1, 3), (2, 4, 8)],
    "ddp": [(2, 1, 3), (4, 4, 8)],
    "fsdp_acc": [(4, 1, 3), (3, 4, 6), (4, 7, 8)],
}


def dataset():
    """Sample ``i`` is ``(i, SEQ + 1 token ids)``: every batch says which samples it holds."""
    return Indexed(SAMPLES, SEQ + 1, 256)


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=SEQ, d_model=16, n_layer=2, n_head=2))


def loader(batch=BATCH):
    return DataLoader(dataset(), batch_size=batch, shuffle=True)


def schedule(optim):
    """The LR halves every 3 steps: a scheduler that did not come back at the new world changes the weights."""
    return torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)


def global_order(epoch: int) -> list[int]:
    """The run's global order: what one process reads, at any data size."""
    return global_order_of(dataset(), epoch)


def shifted(batch):
    """A batch of ``(ids, tokens)`` as ``(inputs, next-token targets)``."""
    return batch[1][:, :-1], batch[1][:, 1:]


@functools.cache
def reference(opt: str):
    """One process, plain torch, on the run's global batches: (losses, ids per step, final weights)."""
    model = gpt()
    optim = OPTIMIZERS[opt](model.parameters())
    return reference_run(model, optim, dataset(), BATCH, TOTAL, shifted, lm_loss, schedule(optim))


def _full_params(model) -> dict[str, np.ndarray]:
    """This rank's parameters as whole tensors (a pipeline rank holds its stage's only)."""
    return eq.plain(eq.full_params(model))


def run_phase(case: str, opt: str, directory: str, first: int, last: int) -> dict:
    """Apply the case's plan at this world, load the previous phase (if any), train to ``last``, save."""
    model = gpt()
    plan = PLANS[case]()
    model, optim, data = plan(model, OPTIMIZERS[opt](model.parameters()), loader())
    sched = schedule(optim)
    step = 0
    if first > 1:
        step, _ = ca.load_state(f"{directory}/{case}-{opt}", model, optim, data, scheduler=sched, verbose=False)
        assert step == first - 1
    epoch, record, window = data.epoch, [], []
    while step < last:
        data.sampler.set_epoch(epoch)
        for ids, tokens in data:
            loss = ca.train_step(model, optim, tokens[:, :-1], tokens[:, 1:], lm_loss)
            window.append((loss, ids.tolist()))
            if optim.micro_step:  # inside an accumulation window
                continue
            sched.step()
            step += 1
            # equal micro-batches: the mean of their mean losses is the global batch's mean loss
            record.append((step, sum(x for x, _ in window) / len(window), [i for _, b in window for i in b]))
            window = []
            if step >= last:
                break
        epoch += 1
    ca.save_state(f"{directory}/{case}-{opt}", model, optim, data, step=last, scheduler=sched)
    notes = plan.explain()
    return {"record": record, "params": _full_params(model), "data_size": data.sampler.num_replicas, "plan": notes}


def group(rank, world, directory, phases, extra=None):
    out = {(case, opt): run_phase(case, opt, directory, a, b) for case, a, b in phases for opt in OPTIMIZERS}
    if extra is not None:
        out["extra"] = extra(rank, world, directory)
    return out


def refusals(rank, world, directory):
    """At world 3: a global batch that does not divide is a ConfigError before any work; a load that
    cannot continue the data position changes nothing."""
    out = {}
    model = gpt()
    try:
        PLANS["fsdp"]()(model, torch.optim.SGD(model.parameters(), lr=0.1), loader(batch=8))
    except ConfigError as exc:
        out["batch8"] = str(exc)
    model = gpt()
    plan_model, optim, data = PLANS["fsdp"]()(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader(36))
    before = _full_params(plan_model)
    try:  # saved 2 steps into epoch 1 = 24 samples: no whole number of global batches of 36
        ca.load_state(f"{directory}/fsdp-adamw", plan_model, optim, data, verbose=False)
    except ConfigError as exc:
        out["load"] = str(exc)
    after = _full_params(plan_model)
    out["unchanged"] = all(np.array_equal(before[n], after[n]) for n in before) and not optim.optimizer.state
    return out


def pipeline_of_one(rank, world, directory):
    """pipeline_parallel owns gradient sync: at a pipeline size of 1 it still averages over the data ranks."""
    model = gpt()
    plan = ca.compose(ca.pipeline_parallel(microbatches=2), ca.parallel_mode([("pipeline", 1), ("data", 2)]))
    model, optim, data = plan(model, OPTIMIZERS["sgd"](model.parameters()), loader())
    losses = []
    for _, tokens in data:
        losses.append(ca.train_step(model, optim, tokens[:, :-1], tokens[:, 1:], lm_loss))
        if len(losses) == 2:
            break
    return {"losses": losses, "params": _full_params(model)}


@pytest.mark.dist
def test_resume_at_other_worlds_and_layouts_trains_every_sample_once_on_the_same_math(tmp_path):
    directory = str(tmp_path)

    def phases(world, index):
        return [(c, p[index][1], p[index][2]) for c, p in PHASES.items() if len(p) > index and p[index][0] == world]

    results: dict = collections.defaultdict(list)  # (case, opt) -> [per-rank results of each phase]
    for world, wanted, extra in (
        (4, phases(4, 0), None),
        (3, phases(3, 1), refusals),
        (2, phases(2, 1) + phases(2, 0), pipeline_of_one),
        (4, phases(4, 2) + phases(4, 1), None),
    ):
        per_rank = run_world(group, world, directory, wanted, extra, timeout=900)
        for key in per_rank[0]:
            results[key].append([r[key] for r in per_rank] if key != "extra" else per_rank[0][key])

    refused = results["extra"][0]
    assert "global batch" in refused["batch8"] and "world sizes where 8 divides: 1, 2, 4, 8" in refused["batch8"]
    assert "24 samples" in refused["load"] and refused["unchanged"]

    one_stage = results["extra"][1]  # rank 0's; the step-2 loss is off unless step 1 averaged gradients
    assert max(abs(a - b) for a, b in zip(one_stage["losses"], reference("sgd")[0][:2])) < 1e-5

    for opt in OPTIMIZERS:
        ref_losses, ref_ids, ref_params = reference(opt)
        for case, phases_of in PHASES.items():
            steps, params = [], {}
            for (world, _, _), per_rank in zip(phases_of, results[(case, opt)], strict=True):
                data_size = per_rank[0]["data_size"]
                for i in range(len(per_rank[0]["record"])):
                    step, loss, _ = per_rank[0]["record"][i]
                    seen = collections.Counter(x for r in per_rank for x in r["record"][i][2])
                    # every rank of one data shard read the same samples; the data shards split the batch
                    assert set(seen.values()) == {world // data_size}, (case, opt, step, seen)
                    steps.append((step, loss, sorted(seen)))
                    assert all(r["record"][i][1] == loss for r in per_rank), (case, opt, step)
                for r in per_rank:
                    params.update(r["params"])
            assert [s for s, _, _ in steps] == list(range(1, TOTAL + 1)), case
            # no sample skipped or repeated: each step's batch is the uninterrupted run's
            assert [ids for _, _, ids in steps] == ref_ids, (case, opt)
            gaps = [abs(loss - ref) for (_, loss, _), ref in zip(steps, ref_losses, strict=True)]
            assert max(gaps) < 1e-4, (case, opt, gaps)
            assert sorted(params) == sorted(ref_params), case
            worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
            assert worst < 1e-4, (case, opt, worst)
    # each epoch's batches are a partition of the dataset
    for epoch in range(TOTAL * BATCH // SAMPLES):
        per_epoch = ref_ids[epoch * 4 : (epoch + 1) * 4]
        assert sorted(i for b in per_epoch for i in b) == list(range(SAMPLES))
    # explain() says how the layout was refitted at the new world
    tp_at_2 = results[("tp_fsdp", "sgd")][1][0]["plan"]
    assert "refitted to world 2: data 2 -> 1, tensor 2 kept as given" in tp_at_2


# -- in one process: the position in global samples, the layout refit, the typed refusals ---------
def _rank_loaders(replicas: int, per_rank: int, seed: int = 0) -> list:
    return [
        resumable(
            DataLoader(
                dataset(),
                batch_size=per_rank,
                sampler=DistributedSampler(dataset(), num_replicas=replicas, rank=r, shuffle=True, seed=seed),
            )
        )
        for r in range(replicas)
    ]


def test_position_in_global_samples_continues_at_another_split():
    """4 data ranks x 3 read 2 batches (24 samples); 3 data ranks x 2 (micro-batches of 6 global)
    skip exactly those 24 and read the rest of the epoch: every sample once."""
    seen = []
    before = _rank_loaders(4, 3)
    iters = [iter(x) for x in before]
    for _ in range(2):
        for it in iters:
            seen += next(it)[0].tolist()
    saved = before[0].position.to_json()
    assert (saved["samples"], saved["per_batch"], saved["order"]["seed"]) == (24, 12, 0)
    after = _rank_loaders(3, 2)
    for x in after:
        x.resume_at(saved, replay=False)
        seen += [i for ids, _ in x for i in ids.tolist()]
    assert sorted(seen) == list(range(SAMPLES))
    assert sorted(seen[:24]) == sorted(global_order(0)[:24])  # the first 24 of the run's global order
    # another sampler seed is another order: refused, not continued
    with pytest.raises(ConfigError, match="sample order"):
        _rank_loaders(3, 2, seed=1)[0].resume_at(saved, replay=False)
    # samples that do not fill whole batches of the new split: refused
    with pytest.raises(ConfigError, match="24 samples"):
        _rank_loaders(3, 6)[0].resume_at(saved, replay=False)  # 18 per global batch


def test_global_batch_that_does_not_divide_names_the_worlds_that_would_work():
    with pytest.raises(ConfigError, match=r"world sizes where 12 divides: 1, 2, 3, 4, 6, 12"):
        check_global_batch(loader(12), plan_layout([("data", 1)], 5))
    with pytest.raises(ConfigError, match=r"world sizes where 12 divides: 2, 4, 6, 8, 12, 24"):
        check_global_batch(loader(12), plan_layout([("tensor", 2), ("data", 1)], 10))
    assert check_global_batch(loader(12), plan_layout([("tensor", 2), ("data", 4)], 6)) == 12
    assert fitting_worlds(8, 1) == [1, 2, 4, 8]


def test_plan_refits_the_data_size_and_says_why():
    for groups, world, line in (
        ([("tensor", 2), ("data", 4)], 6, "refitted to world 6: data 4 -> 3, tensor 2 kept as given"),
        ([("tensor", 2), ("data", 2)], 2, "refitted to world 2: data 2 -> 1, tensor 2 kept as given"),
        ([("pipeline", 2), ("data", 2)], 2, "refitted to world 2: data 2 -> 1, pipeline 2 kept as given"),
        ([("data", 4)], 3, "refitted to world 3: data 4 -> 3 (data 3 = world 3)"),
    ):
        text = ca.compose(ca.parallel_mode(groups), env=ca.Environment(world_size=world)).explain()
        assert line in text, text
    # model-parallel sizes are the user's memory plan: a world they do not divide is refused, naming
    # the nearest layout there and the worlds that keep them
    with pytest.raises(ConfigError, match=r"nearest layout is tensor 2 x pipeline 1 x data 3 .* world 4 or 8"):
        ca.compose(ca.parallel_mode([("tensor", 2), ("pipeline", 2), ("data", 1)]), env=ca.Environment(world_size=6))
    with pytest.raises(ConfigError, match=r"nearest layout is tensor 1 x pipeline 1 x data 3"):
        ca.compose(ca.mixed_parallel(tensor=2, pipeline=2), env=ca.Environment(world_size=3))
    assert nearest_model_degrees((("tensor", 4), ("pipeline", 2)), 6) == (("tensor", 2), ("pipeline", 1))


def test_accumulation_refits_to_the_per_rank_share():
    from composable_atorch.transforms.loop import refit_steps

    # global 12 with accumulate(2): at data 4 the share of 3 is read as 3 micro-batches of 1
    assert [refit_steps(share, 2) for share in (12, 6, 4, 3)] == [2, 2, 2, 3]
    assert refit_steps(10, 4) == 5 and refit_steps(3, 4) == 3


def test_a_stateless_optimizer_gets_its_scheduled_lr_back(tmp_path):
    """SGD without momentum has no state for DCP to carry its groups' LR: the scheduler's step would
    come back (last_epoch) while the LR went back to the constructor's."""

    def setup():
        model = gpt()
        optim = torch.optim.SGD(model.parameters(), lr=0.2)
        return model, optim, schedule(optim)

    model, optim, sched = setup()
    for _ in range(3):
        optim.step()
        sched.step()
    ca.save_state(tmp_path, model, optim, step=3, scheduler=sched)
    model, optim, sched = setup()
    ca.load_state(tmp_path, model, optim, scheduler=sched, verbose=False)
    assert optim.param_groups[0]["lr"] == sched.get_last_lr()[0] == 0.1

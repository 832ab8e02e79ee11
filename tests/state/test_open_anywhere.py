"""A checkpoint opens in any layout: every saved layout into the plain model in one process (no
plan, a plain shuffling DataLoader: how a user evaluates, exports or fine-tunes elsewhere), also
after a save killed midway; and tensor x pipeline moves to fsdp at another world and back.

Weights and optimizer state are compared exactly with the saving ranks' own (gathered) state;
the resumed training with one plain-torch process on the run's global batches.
"""

from __future__ import annotations

import collections
import functools
import os
import signal

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader

import composable_atorch as ca
import equivalence as eq
from _resharding import Indexed, reference_run, train_phase
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.runtime.resumable import is_resumable
from composable_atorch.state import files
from composable_atorch.state import save as save_module

from _dist import run_world

SEQ, SAMPLES, BATCH = 8, 48, 12
FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
PLAIN = StateDictOptions(flatten_optimizer_state_dict=True)


def dataset():
    """Sample ``i`` is ``(i, SEQ + 1 token ids)``: every batch says which samples it holds."""
    return Indexed(SAMPLES, SEQ + 1, 256)


def gpt(seed: int = 0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=SEQ, d_model=16, n_layer=2, n_head=2))


def plain_loader():
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


def mixed(data: int):
    return lambda: ca.compose(ca.mixed_parallel(), ca.parallel_mode([("tensor", 2), ("pipeline", 2), ("data", data)]))


#: layout -> (world, plan)
LAYOUTS = {
    "ddp": (2, lambda: ca.compose(ca.ddp())),
    "fsdp": (2, lambda: ca.compose(ca.fsdp(wrap=(Block,)))),
    "tensor": (2, lambda: ca.compose(ca.tensor_parallel(), ca.parallel_mode([("tensor", 2), ("data", 1)]))),
    "pipeline": (
        2,
        lambda: ca.compose(ca.pipeline_parallel(microbatches=2), ca.parallel_mode([("pipeline", 2), ("data", 1)])),
    ),
    "tensor_pipeline": (4, mixed(1)),
}


def full_state(model, optim) -> dict[str, np.ndarray]:
    """This rank's model and optimizer state as whole tensors (a pipeline rank: its stage's)."""
    inner = getattr(optim, "optimizer", optim)
    model_sd, optim_sd = get_state_dict(model, [inner], options=FULL)
    out = {f"model.{k}": v for k, v in model_sd.items()}
    out.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().numpy() for k, v in out.items()}


def plain_state(model, optim) -> dict[str, np.ndarray]:
    model_sd, optim_sd = get_state_dict(model, [optim], options=PLAIN)
    out = {f"model.{k}": v for k, v in model_sd.items()}
    out.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return {k: v.detach().numpy() for k, v in out.items()}


def train_and_save(rank, world, directory, names):
    """Two AdamW steps under each layout, saved with the plan's loader; the gathered state."""
    out = {}
    for name in names:
        model = gpt()
        model, optim, data = LAYOUTS[name][1]()(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plain_loader())
        for _, (_, tokens) in zip(range(2), data):
            ca.train_step(model, optim, tokens[:, :-1], tokens[:, 1:], lm_loss)
        ca.save_state(f"{directory}/{name}", model, optim, data, step=2, extra={"layout": name})
        out[name] = full_state(model, optim)
    return out


@pytest.fixture(scope="module")
def saved_layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    states: dict[str, dict] = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        for per_rank in [run_world(train_and_save, world, str(root), names, timeout=600)]:
            for name in names:
                states[name] = {k: v for r in per_rank for k, v in r[name].items()}
    return root, states


def open_plainly(directory, **kwargs):
    model = gpt(seed=1)  # other initial weights: everything must come from the checkpoint
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    loader = plain_loader()
    return model, optim, loader, ca.load_state(directory, model, optim, loader, verbose=False, **kwargs)


def assert_equal_state(mine: dict, ref: dict):
    assert sorted(mine) == sorted(ref)
    different = [k for k in ref if not np.array_equal(mine[k], ref[k])]
    assert not different, different[:5]


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_opens_in_one_process_with_a_plain_shuffling_loader(saved_layouts, layout):
    root, states = saved_layouts
    model, optim, loader, resumed = open_plainly(root / layout)
    assert (resumed.step, resumed.extra) == (2, {"layout": layout})
    assert_equal_state(plain_state(model, optim), states[layout])
    assert optim.param_groups[0]["lr"] == 1e-2
    # the loader reads another order: left as given, and the result says so
    assert not resumed.data_position_carried and not is_resumable(loader)
    assert "NOT carried over" in resumed.explain() and "RandomSampler" in resumed.data_position
    assert "not carried over" in repr(resumed)
    _, tokens = next(iter(loader))  # training goes on from the loaded weights
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    optim.step()


@pytest.mark.dist
def test_exact_resume_refuses_another_order_and_changes_nothing(saved_layouts):
    root, _ = saved_layouts
    model, optim = gpt(seed=1), None
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="exact_resume") as err:
        ca.load_state(root / "fsdp", model, optim, plain_loader(), verbose=False, exact_resume=True)
    assert "DistributedSampler" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not optim.state
    with pytest.raises(ConfigError, match="exact_resume"):
        ca.load_state(root / "fsdp", model, optim, None, verbose=False, exact_resume=True)


# -- a save killed midway: the previous complete checkpoint opens in one process -------------------
def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def crash_while_saving(rank, world, directory, mode):
    """fsdp at world 2: save step 2 (its gathered state to ``ref-2.npz``), train a step, then
    ``shard``: save step 3, rank 1 killed while writing its shard; ``publish`` / ``pointer``: rank 0
    killed before the rename into place / before latest.json moves; ``resave``: save step 2 again,
    rank 0 killed in the middle of swapping the new copy in (the old one moved aside)."""
    model = gpt()
    model, optim, data = LAYOUTS["fsdp"][1]()(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plain_loader())
    batches = iter(data)
    for step in (1, 2, 3):
        _, tokens = next(batches)
        ca.train_step(model, optim, tokens[:, :-1], tokens[:, 1:], lm_loss)
        if step >= 2:
            state = full_state(model, optim)
            if rank == 0:
                np.savez(f"{directory}/ref-{step}.npz", **state)
        if step == 2:
            ca.save_state(f"{directory}/ckpt", model, optim, data, step=2)
    if mode == "shard" and rank == 1:
        real_fsync, calls = os.fsync, []

        def fsync(fd):
            calls.append(fd)
            if len(calls) == 1:  # 1st: its DCP shard (this rank's JSON follows DCP's files)
                _die()
            real_fsync(fd)

        os.fsync = fsync
    if mode == "publish" and rank == 0:  # every file written, before the directory is renamed into place
        save_module.publish = lambda *args: _die()
    if mode == "pointer" and rank == 0:  # renamed into place, before latest.json moves
        real_write = files.write_json

        def write_json(path, data):
            if path.name == files.LATEST:
                _die()
            real_write(path, data)

        files.write_json = write_json
    if mode == "resave" and rank == 0:
        real_replace = os.replace

        def replace(src, dst):
            if str(src).endswith(files.RESAVED):  # the old copy is moved aside, the new one not yet in place
                _die()
            real_replace(src, dst)

        files.os.replace = replace
    ca.save_state(f"{directory}/ckpt", model, optim, data, step=3 if mode == "shard" else 2)
    return "the save was supposed to be killed"


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["shard", "publish", "pointer", "resave"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_open_in_one_process(tmp_path, mode):
    # the killed rank, or its peer losing the connection first, is what the group reports
    with pytest.raises(AssertionError, match=r"died without a result: killed by signal SIGKILL|Connection closed"):
        run_world(crash_while_saving, 2, str(tmp_path), mode, timeout=300)
    model, optim, _, resumed = open_plainly(tmp_path / "ckpt")
    assert resumed.step == 2 and not resumed.data_position_carried
    refs = [dict(np.load(tmp_path / f"ref-{s}.npz")) for s in (2, 3)]
    mine = plain_state(model, optim)
    if mode != "resave":  # step 3 never completed: step 2 as first saved
        assert_equal_state(mine, refs[0])
    else:  # either complete copy of step 2 (the re-save wrote step 3's weights under step 2)
        assert any(all(np.array_equal(mine[k], ref[k]) for k in ref) for ref in refs)


# -- tensor 2 x pipeline 2 -> fsdp at world 2 -> back: the uninterrupted run, every sample once ------
OPTIMIZERS = eq.optimizers(sgd=dict(lr=0.2, momentum=0.9), adamw=dict(lr=1e-2, eps=1e-4))  # eps: see equivalence
TOTAL = 8  # 4 steps per epoch: the run crosses into epoch 1
MOVES = {"tensor_pipeline": mixed(1), "fsdp": LAYOUTS["fsdp"][1], "tensor_pipeline_data": mixed(2)}


def schedule(optim):
    return torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)


@functools.cache
def reference(opt: str):
    """One process, plain torch, on the run's global order: (losses, ids per step)."""
    model = gpt()
    optim = OPTIMIZERS[opt](model.parameters())
    inputs = lambda b: (b[1][:, :-1], b[1][:, 1:])  # noqa: E731 - (ids, tokens) -> (inputs, next tokens)
    return reference_run(model, optim, dataset(), BATCH, TOTAL, inputs, lm_loss, schedule(optim))[:2]


def phase(rank, world, directory, layout, first, last):
    out = {}
    for opt in OPTIMIZERS:
        model = gpt()
        model, optim, data = MOVES[layout]()(model, OPTIMIZERS[opt](model.parameters()), plain_loader())
        sched = schedule(optim)

        def step_fn(batch, model=model, optim=optim, sched=sched):
            ids, tokens = batch
            loss = ca.train_step(model, optim, tokens[:, :-1], tokens[:, 1:], lm_loss)
            sched.step()
            return loss, ids.tolist()

        where = f"{directory}/{opt}"
        out[opt] = train_phase(model, optim, data, where, first, last, step_fn, scheduler=sched, exact_resume=True)
        ca.save_state(where, model, optim, data, step=last, scheduler=sched)
    return out


def check_moves(directory: str, phases):
    steps = {opt: [] for opt in OPTIMIZERS}
    for world, layout, first, last in phases:
        per_rank = run_world(phase, world, directory, layout, first, last, timeout=900)
        for opt in OPTIMIZERS:
            for i, (step, loss, _) in enumerate(per_rank[0][opt]):
                seen = collections.Counter(x for r in per_rank for x in r[opt][i][2])
                steps[opt].append((step, loss, sorted(seen)))
    for opt, run in steps.items():
        ref_losses, ref_ids = reference(opt)
        assert [s for s, _, _ in run] == list(range(1, TOTAL + 1))
        assert [ids for _, _, ids in run] == ref_ids, opt  # every sample once per epoch, in the run's order
        gaps = [abs(loss - ref) for (_, loss, _), ref in zip(run, ref_losses, strict=True)]
        assert max(gaps) < 1e-4, (opt, gaps)


@pytest.mark.dist
def test_tensor_pipeline_resumes_under_fsdp_at_another_world_and_back(tmp_path):
    check_moves(str(tmp_path), [(4, "tensor_pipeline", 1, 3), (2, "fsdp", 4, 6), (4, "tensor_pipeline", 7, 8)])


@pytest.mark.dist
@pytest.mark.slow
def test_tensor_pipeline_data_at_world8_resumes_under_fsdp_at_world2_and_back(tmp_path):
    check_moves(
        str(tmp_path), [(8, "tensor_pipeline_data", 1, 3), (2, "fsdp", 4, 6), (8, "tensor_pipeline_data", 7, 8)]
    )


def test_a_checkpoint_without_a_position_or_a_loader_without_an_index_loads_the_weights(tmp_path):
    model = gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ca.save_state(tmp_path, model, optim, step=1)  # saved without a loader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    for loader, says in (
        (plain_loader(), "holds no data position"),
        (DataLoader(Stream(), batch_size=2), "no index to resume at"),
    ):
        other = gpt(seed=1)
        resumed = ca.load_state(tmp_path, other, torch.optim.AdamW(other.parameters()), loader, verbose=False)
        assert not resumed.data_position_carried and says in resumed.data_position and not is_resumable(loader)
        assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
        with pytest.raises(ConfigError, match="exact_resume"):
            ca.load_state(tmp_path, other, torch.optim.AdamW(other.parameters()), loader, exact_resume=True)

"""save_state(..., asynchronous=True): returns after staging, training goes on, and the checkpoint
is the one a blocking save writes (same manifest and checks); none is lost to the next save or to
the process exiting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, Block, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state import files
from composable_atorch.state.inflight import SaveInFlight

from _dist import run_world

PLAIN = StateDictOptions(flatten_optimizer_state_dict=True)


def build(plan=None, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=8, d_model=16, n_layer=2, n_head=2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TextDataset(8, limit=32), batch_size=4, shuffle=True)
    return (plan or ca.compose())(model, optim, loader)


def step(model, optim, batches):
    x, y = next(batches)
    ca.train_step(model, optim, x, y, lm_loss)


def state_of(model, optim) -> dict[str, np.ndarray]:
    """Model and optimizer tensors by name, whole (gathered from shards: collective under fsdp)."""
    inner = getattr(optim, "optimizer", optim)
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, [inner], options=full if torch.distributed.is_initialized() else PLAIN)
    out = {f"model.{k}": v for k, v in model_sd.items()}
    out.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return {k: v.detach().clone().numpy() for k, v in out.items()}


def loaded(directory) -> dict[str, np.ndarray]:
    model, optim, _ = build(seed=1)
    ca.load_state(directory, model, optim, verbose=False)
    return state_of(model, optim)


def assert_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    assert not [k for k in a if not np.array_equal(a[k], b[k])]


def test_an_asynchronous_save_is_the_state_at_the_save_while_training_goes_on(tmp_path):
    model, optim, loader = build()
    batches = iter(loader)
    step(model, optim, batches)
    at_1 = state_of(model, optim)
    first = ca.save_state(tmp_path, model, optim, loader, step=1, asynchronous=True)
    assert isinstance(first, SaveInFlight) and os.fspath(first) == str(tmp_path / "step-00000001")
    step(model, optim, batches)  # changes weights and moments while the files may still be written
    at_2 = state_of(model, optim)
    second = ca.save_state(tmp_path, model, optim, loader, step=2, asynchronous=True)  # waits for the first
    assert first.done()
    step(model, optim, batches)
    assert second.wait() == tmp_path / "step-00000002" and second.done()
    assert files.latest_checkpoint(tmp_path).name == "step-00000002"
    assert_equal(loaded(tmp_path / "step-00000001"), at_1)
    assert_equal(loaded(tmp_path), at_2)
    # the same manifest as a blocking save: every file listed with its checksum, checkpoint.json sealed
    meta = json.loads((tmp_path / "step-00000002" / files.META).read_text())
    assert {"rank-0.json", ".metadata"} <= set(meta["files"]) and meta["checksum"]
    blocking = ca.save_state(tmp_path / "blocking", *build(), step=0)
    assert sorted(json.loads((blocking / files.META).read_text())["files"]) == sorted(meta["files"])


def test_load_state_waits_for_a_save_in_flight(tmp_path):
    model, optim, loader = build()
    step(model, optim, iter(loader))
    at_1 = state_of(model, optim)
    ca.save_state(tmp_path, model, optim, loader, step=1, asynchronous=True)
    assert_equal(loaded(tmp_path), at_1)  # no wait by the user: load_state published it first


def test_asynchronous_must_be_a_bool(tmp_path):
    model, optim, loader = build()
    with pytest.raises(ConfigError, match="asynchronous"):
        ca.save_state(tmp_path, model, optim, loader, step=1, asynchronous="yes")


@pytest.mark.dist  # a fresh Python process
def test_a_save_in_flight_at_process_exit_is_published(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]
        from test_async_save import build, step, state_of
        import numpy as np
        import composable_atorch as ca
        model, optim, loader = build()
        step(model, optim, iter(loader))
        np.savez({str(tmp_path / "ref.npz")!r}, **state_of(model, optim))
        ca.save_state({str(tmp_path / "ckpt")!r}, model, optim, loader, step=1, asynchronous=True)
        # the script ends here, the files still being written
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert files.latest_checkpoint(tmp_path / "ckpt").name == "step-00000001"
    assert_equal(loaded(tmp_path / "ckpt"), dict(np.load(tmp_path / "ref.npz")))


def async_in_group(rank, world, directory):
    """fsdp at world 2: a blocking and an asynchronous save of each step, training between them."""
    model, optim, loader = build(ca.compose(ca.fsdp(wrap=(Block,))))
    batches, states = iter(loader), []
    for n in (1, 2, 3):
        step(model, optim, batches)
        states.append(state_of(model, optim))
        ca.save_state(f"{directory}/async", model, optim, loader, step=n, asynchronous=True)
    ca.wait_for_saves()
    return states


@pytest.mark.dist
def test_asynchronous_fsdp_saves_at_world2_load_equal_in_one_process(tmp_path):
    per_rank = run_world(async_in_group, 2, str(tmp_path))
    for n, state in enumerate(per_rank[0], start=1):
        assert_equal(loaded(tmp_path / "async" / f"step-{n:08d}"), state)

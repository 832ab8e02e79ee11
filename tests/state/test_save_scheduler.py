"""save_state / load_state with an LR scheduler: a resumed run follows the uninterrupted one's LRs."""

from __future__ import annotations

import pytest
import torch

import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, GPTConfig

CFG = GPTConfig(seq_len=16, d_model=32, n_layer=1, n_head=2)


def setup():
    torch.manual_seed(0)
    model = GPT(CFG)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=1e-2, total_steps=8)
    data = torch.randint(0, 256, (16, CFG.seq_len + 1), generator=torch.Generator().manual_seed(3))
    loader = ca.resumable(
        torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4))
    )
    return model, optim, sched, loader


def train(model, optim, sched, loader, steps: int, start: int = 0):
    lrs, losses, step = [], [], start
    for batch in loader:
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        step += 1
        lrs.append(sched.get_last_lr()[0])
        losses.append(loss.item())
        if step == steps:  # stop before fetching another batch: the loader counts what it handed out
            break
    return lrs, losses


def test_resumed_run_follows_the_scheduler_and_says_what_it_skips(tmp_path, capsys):
    full_lrs, full_losses = train(*setup(), steps=6)

    model, optim, sched, loader = setup()
    first_lrs, _ = train(model, optim, sched, loader, steps=3)
    ca.save_state(tmp_path, model, optim, loader, step=3, scheduler=sched)

    model, optim, sched, loader = setup()
    step, _ = ca.load_state(tmp_path, model, optim, loader, scheduler=sched)
    assert sched.last_epoch == 3 and optim.param_groups[0]["lr"] == first_lrs[-1]
    rest_lrs, rest_losses = train(model, optim, sched, loader, steps=6, start=step)
    assert first_lrs + rest_lrs == full_lrs
    assert rest_losses == full_losses[3:]


def test_resume_message(tmp_path, capsys):
    model, optim, sched, loader = setup()
    train(model, optim, sched, loader, steps=2)
    ca.save_state(tmp_path, model, optim, loader, step=2, scheduler=sched)
    model, optim, sched, loader = setup()
    capsys.readouterr()
    ca.load_state(tmp_path, model, optim, loader, scheduler=sched)
    out = capsys.readouterr().out
    assert "at step 2" in out and "skipping the 2 batch(es) of epoch 0 already seen" in out
    ca.load_state(tmp_path, model, optim, loader, scheduler=sched, verbose=False)
    assert capsys.readouterr().out == ""


def test_scheduler_errors(tmp_path):
    model, optim, sched, loader = setup()
    train(model, optim, sched, loader, steps=1)
    with pytest.raises(ConfigError, match="scheduler"):
        ca.save_state(tmp_path, model, optim, loader, step=1, scheduler=object())
    ca.save_state(tmp_path, model, optim, loader, step=1)
    with pytest.raises(ConfigError, match="no LR scheduler state"):
        ca.load_state(tmp_path, model, optim, loader, scheduler=sched)


def test_is_boundary_says_which_micro_step_syncs_and_steps():
    """Accelerate's ``sync_gradients``.

    ``optim.is_boundary`` before ``optim.step()``, ``optim.sync_gradients`` after.
    """
    model, optim, _, loader = setup()
    model, optim, loader = ca.compose(ca.accumulate(2))(model, optim, loader)
    seen = []
    for batch in loader:
        before = [p.detach().clone() for p in model.parameters()]
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        optim.backward(loss)
        syncs = optim.is_boundary
        optim.step()
        optim.zero_grad()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert optim.sync_gradients == syncs  # still describes this micro-step after step()
        seen.append((syncs, changed))
        if len(seen) == 4:
            break
    assert seen == [(False, False), (True, True), (False, False), (True, True)]

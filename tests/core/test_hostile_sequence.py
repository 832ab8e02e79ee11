"""Hostile inputs on the sequence and expert features (issue 29): context_parallel (both
rotations), ATorch's Ulysses sequence_parallel and expert_parallel.

Each input is either a typed error from composable_atorch.errors before any work (the model's
weights as they were, nothing half-applied) or correct training. Every distributed case runs under
run_world's timeout: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

import _seq
import composable_atorch as ca
import equivalence as eq
from composable_atorch.errors import CheckpointError, CompositionError, ConfigError, UnknownTransformError

from _dist import module_world, run_world

ENV2 = ca.Environment(world_size=2)


# ---------------------------------------------------------------------------------------------
# saved strategies (JSON) and ATorch strategy lists: refused at load, before any process group
# ---------------------------------------------------------------------------------------------


def _context_json(**change) -> str:
    plan = json.loads(
        ca.compose(ca.parallel_mode([("context", 2), ("data", 1)]), ca.context_parallel(), env=ENV2).to_json()
    )
    if "groups" in change:
        plan["transforms"][0]["config"]["groups"] = change.pop("groups")
    if "transform" in change:
        plan["transforms"][1] = change.pop("transform")
    plan["transforms"][1]["config"].update(change)
    return json.dumps(plan)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (_context_json(groups=[["context", 3], ["data", 1]]), "context 3 = 3, and 2 / 3 is not an integer"),
        (_context_json(groups=[["context", 4], ["data", 1]]), "context 4 = 4, and 2 / 4"),
        (_context_json(groups=[["expert", 3], ["data", 1]]), "expert 3 = 3, and 2 / 3"),
        (_context_json(groups=[["context", -2], ["data", -1]]), "size of 'context': -2; allowed: an integer >= 1"),
        (_context_json(groups=[["context", 0], ["data", 1]]), "size of 'context': 0"),
        (_context_json(groups=[["context", 2.0], ["data", 1]]), "size of 'context': 2.0"),
        (_context_json(groups=[["context", 1.5], ["data", 1]]), "size of 'context': 1.5"),
        (_context_json(groups=[["context", True], ["data", 2]]), "size of 'context': True"),
        (_context_json(groups=[["context", "2"], ["data", 1]]), "size of 'context': '2'"),
        (_context_json(groups=[["expert", -2], ["data", -1]]), "size of 'expert': -2"),
        (_context_json(rotation="spiral"), "rotation: 'spiral'; allowed: 'allgather' or 'ring'"),
        (_context_json(rotation="Ring"), "rotation: 'Ring'"),
        (_context_json(rotation=None), "rotation: None"),
        (_context_json(positions="yes"), "positions: 'yes'; allowed: True or False"),
        (_context_json(evil=1), "config field 'evil'"),
        (_context_json(positions={"$class": "subprocess:Popen", "args": ["true"]}), "subprocess"),
        (_context_json(positions={"$class": "subprocess.Popen"}), "identifiers only"),
        (_context_json(positions={"__class__": "os.system"}), "positions"),
    ],
)
def test_saved_context_strategy_is_refused_at_load(text, match):
    with pytest.raises(ConfigError, match=match):
        ca.Plan.from_json(text, env=ENV2)


@pytest.mark.parametrize("inert", [["os.system"], "module", [1], {"$class": "os:system"}])
def test_saved_ulysses_inert_keys_are_names_from_a_fixed_list(inert):
    plan = json.loads(ca.strategy.load([("sequence_parallel", {"sp_size": 2, "module": None})], env=ENV2).to_json())
    entry = next(t for t in plan["transforms"] if t["name"] == "sequence_parallel")
    entry["config"]["inert"] = inert
    with pytest.raises(ConfigError):
        ca.Plan.from_json(json.dumps(plan), env=ENV2)


def test_saved_strategy_naming_a_dangerous_class_as_a_transform():
    text = _context_json(transform={"name": "os.system", "config": {}})
    with pytest.raises(UnknownTransformError, match="unknown transform 'os.system'"):
        ca.Plan.from_json(text, env=ENV2)


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        ([("parallel_mode", ([("context", 3)], None)), "context_parallel"], "context 3 = 3, not 2"),
        ([("parallel_mode", ([("context", True), ("data", 1)], None)), "context_parallel"], "True"),
        ([("parallel_mode", ([("expert", 3), ("expert_fsdp", 1)], None)), "expert_parallel"], "expert 3 = 3"),
        ([("parallel_mode", ([("expert", 2.0)], None)), "expert_parallel"], "2.0"),
        ([("sequence_parallel", {"sp_size": 0})], "sp_size: 0"),
        ([("sequence_parallel", {"sp_size": -2})], "sp_size: -2"),
        ([("sequence_parallel", {"sp_size": True})], "sp_size: True"),
        ([("sequence_parallel", {"sp_size": 2.0})], "sp_size: 2.0"),
        ([("sequence_parallel", {"sp_size": 3})], "sequence 3 = 3"),
        ([("context_parallel", {"rotation": "spiral"})], "'allgather' or 'ring'"),
    ],
)
def test_atorch_strategy_lists_with_bad_degrees_are_refused(strategy, match):
    with pytest.raises(ConfigError, match=match):
        ca.strategy.load(strategy, env=ENV2)


# ---------------------------------------------------------------------------------------------
# at world 2: each case returns what happened (error type and text, weights before / after)
# ---------------------------------------------------------------------------------------------


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eq.full_params(model).items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except CompositionError as exc:
        return type(exc).__name__, str(exc)
    except Exception as exc:  # noqa: BLE001 - an untyped error is reported, and fails the test
        return f"untyped {type(exc).__name__}", str(exc)


class Lengths(torch.utils.data.Dataset):
    """Token rows whose length is chosen per index (a batch of length 64, then ``second``)."""

    def __init__(self, second: int, n: int = 8):
        self.second, self.n = second, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        length = _seq.SEQ if i < self.n // 2 else self.second
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 256, (length + 1,), generator=g)
        return x[:-1], x[1:]


def _train(model, optim, data, steps=None, loss_fn=_seq.seq_loss):
    losses = []
    for i, (x, y) in enumerate(data):
        if steps is not None and i >= steps:
            break
        losses.append(ca.train_step(model, optim, x, y, loss_fn))
    return losses


def _step_next(model, optim, batches):
    """One step on the loader's next batch (the loader splits it: a bad length is refused there)."""
    return ca.train_step(model, optim, *next(batches), _seq.seq_loss)


def _context_plan(rotation="allgather"):
    return ca.compose(ca.parallel_mode([("context", 2), ("data", 1)]), ca.context_parallel(rotation=rotation))


def _world2_cases(rank, world, _):
    out = {}

    # a sequence length not divisible by 2n (causal balance; Ulysses: by n) mid-epoch: typed, weights untouched
    ulysses = ca.compose(ca.parallel_mode([("sequence", 2), ("data", 1)]), ca.sequence_parallel())
    for length, plan in ((62, _context_plan()), (63, _context_plan("ring")), ("u63", ulysses)):
        model = _seq.user_lm()
        before = _snapshot(model)
        m, opt, data = plan(
            model,
            _seq.make_optim(model, "sgd"),
            DataLoader(Lengths(63 if length == "u63" else length, 4), batch_size=2),
        )
        it = iter(data)
        next(it)  # the first half of the rows is 64 long; skip it, the next batch is the hostile one
        out[f"len{length}"] = _outcome(_step_next, m, opt, it)
        out[f"len{length}_untouched"] = _same(before, _snapshot(m))

    # a batch whose length changes mid-epoch (64, then 32): trains as one process on the same batches
    for rotation in ("allgather", "ring"):
        ref = _seq.user_lm()
        ropt = _seq.make_optim(ref, "adamw")
        ref_losses = []
        for x, y in DataLoader(Lengths(32, 8), batch_size=2):
            loss = _seq.seq_loss(ref(x), y)
            loss.backward()
            ropt.step()
            ropt.zero_grad()
            ref_losses.append(loss.item())
        model = _seq.user_lm()
        m, opt, data = _context_plan(rotation)(
            model, _seq.make_optim(model, "adamw"), DataLoader(Lengths(32, 8), batch_size=2)
        )
        losses = _train(m, opt, data)
        out[f"varlen_{rotation}"] = (
            max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            eq.max_diff(eq.full_params(m), eq.full_params(ref)),
        )

    # Ulysses with heads not divisible by the sequence size: refused before any weight moves
    model = _seq.user_lm(heads=1, d=32)
    before = _snapshot(model)
    plan = ca.compose(ca.parallel_mode([("sequence", 2), ("data", 1)]), ca.sequence_parallel())
    out["ulysses_heads"] = _outcome(lambda: _train(*plan(model, _seq.make_optim(model, "sgd"), _seq.loader()), 1))
    out["ulysses_heads_untouched"] = _same(before, _snapshot(model))

    # num_experts not divisible by the expert degree: refused at apply, the model's experts whole
    from zoo import moe

    torch.manual_seed(0)
    model = moe.UserMoEModel(vocab=256)
    for blk in model.blocks:
        blk.experts.num_experts = 3
        blk.experts.w_in = torch.nn.Parameter(blk.experts.w_in[:3].detach().clone())
        blk.experts.w_out = torch.nn.Parameter(blk.experts.w_out[:3].detach().clone())
        blk.router = torch.nn.Linear(32, 3, bias=False)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = ca.compose(ca.parallel_mode([("expert", 2), ("data", 1)]), ca.expert_parallel())
    out["experts3"] = _outcome(lambda: plan(model, torch.optim.SGD(model.parameters(), lr=0.1), None))
    after = model.state_dict()
    out["experts3_untouched"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    # a NaN loss under context 2 on one rank only: every rank ends the step the same way, none hangs
    for policy in ("skip", "raise"):
        model = _seq.user_lm()
        tfs = [ca.parallel_mode([("context", 2), ("data", 1)]), ca.context_parallel()]
        if policy == "raise":
            tfs.append(ca.amp("bf16", nonfinite="raise"))
        else:
            tfs.append(ca.amp("bf16"))
        m, opt, data = ca.compose(*tfs)(model, _seq.make_optim(model, "sgd"), _seq.loader())
        before = _snapshot(m)

        def nan_on_rank0(out_, y):
            loss = _seq.seq_loss(out_, y)
            return loss * float("nan") if rank == 0 else loss

        x, y = next(iter(data))
        result = _outcome(ca.train_step, m, opt, x, y, nan_on_rank0)
        out[f"nan_{policy}"] = (result[0], None if result[0] != "ok" else result[1], _same(before, _snapshot(m)))
        # the next, finite step trains on both ranks (the groups were left in step); after a raise the
        # user drops the step's gradients first (train_step leaves them, as the error says the step was not taken)
        if policy == "raise":
            out["nan_raise_again"] = _outcome(ca.train_step, m, opt, x, y, _seq.seq_loss)[0]
            opt.zero_grad()
        out[f"nan_{policy}_next"] = _outcome(ca.train_step, m, opt, x, y, _seq.seq_loss)
        out[f"nan_{policy}_finite"] = out[f"nan_{policy}_next"][0] == "ok" and math.isfinite(
            out[f"nan_{policy}_next"][1]
        )
    return out


world2 = module_world(_world2_cases, 2, None, timeout=400)


@pytest.mark.dist
@pytest.mark.parametrize(("length", "why"), [(62, "multiple of 4"), (63, "multiple of 4"), ("u63", "multiple of 2")])
def test_sequence_not_divisible_by_the_split_is_typed_before_the_step(world2, length, why):
    for r in world2:
        kind, text = r[f"len{length}"]
        assert kind == "ConfigError" and ("63" in text or "62" in text), (kind, text)
        assert why in text, text
        assert r[f"len{length}_untouched"]


@pytest.mark.dist
@pytest.mark.parametrize("rotation", ["allgather", "ring"])
def test_length_changing_mid_epoch_trains_as_one_process(world2, rotation):
    for r in world2:
        loss_gap, param_gap = r[f"varlen_{rotation}"]
        assert loss_gap < 1e-4 and param_gap < 1e-4


@pytest.mark.dist
def test_ulysses_heads_not_divisible_is_typed_and_leaves_the_model(world2):
    for r in world2:
        kind, text = r["ulysses_heads"]
        assert kind == "ConfigError" and "head" in text, (kind, text)
        assert r["ulysses_heads_untouched"]


@pytest.mark.dist
def test_experts_not_divisible_by_the_expert_degree_is_typed(world2):
    for r in world2:
        kind, text = r["experts3"]
        assert kind in ("ConfigError", "ExpertParallelError") and "3" in text, (kind, text)
        assert r["experts3_untouched"]


@pytest.mark.dist
def test_nan_loss_on_one_rank_under_context_2_is_handled_alike_on_every_rank(world2):
    skip = [r["nan_skip"] for r in world2]
    assert all(s[0] == "ok" and s[2] for s in skip), skip  # skipped on both ranks: weights untouched
    raised = [r["nan_raise"] for r in world2]
    assert all(s[0] == "NonFiniteError" and s[2] for s in raised), raised
    for r in world2:
        assert r["nan_raise_again"] == "NonFiniteError"  # the NaN gradients are still there: raised again, alike
        assert r["nan_skip_finite"] and r["nan_raise_finite"], (r["nan_skip_next"], r["nan_raise_next"])
    # the finite step's loss is the same float on both ranks (the whole sequence's mean)
    assert world2[0]["nan_skip_next"] == world2[1]["nan_skip_next"]


# ---------------------------------------------------------------------------------------------
# tiny data under context x data (world 4) and damaged checkpoints saved under context 2
# ---------------------------------------------------------------------------------------------


def _tiny_data(rank, world, batch_size):
    model = _seq.user_lm()
    before = _snapshot(model)
    plan = ca.compose(ca.parallel_mode([("context", 2), ("data", 2)]), ca.context_parallel())
    data = DataLoader(Lengths(_seq.SEQ, 1), batch_size=batch_size)  # one sample, two data ranks
    kind, text = _outcome(lambda: _train(*plan(model, _seq.make_optim(model, "sgd"), data)))
    return kind, text, _same(before, _snapshot(model))


@pytest.mark.dist
@pytest.mark.parametrize(
    ("batch_size", "kind", "match"),
    [(1, "ConfigError", "multiple of the data-parallel size 2"), (2, "DatasetSizeError", "holds 1 sample")],
)
def test_fewer_samples_than_data_ranks_under_context_by_data(batch_size, kind, match):
    for got, text, untouched in run_world(_tiny_data, 4, batch_size, timeout=300):
        assert got == kind and match in text, (got, text)
        assert untouched


def _save_under_context(rank, world, directory):
    model = _seq.user_lm()
    m, opt, data = _context_plan()(model, _seq.make_optim(model, "adamw"), _seq.loader())
    _train(m, opt, data, steps=1)
    ca.save_state(directory, m, opt, data, step=1)
    return True


def _damage(directory, how: str) -> None:
    from pathlib import Path

    files = sorted(p for p in Path(directory).rglob("*.distcp") if p.stat().st_size > 64)
    assert files, list(Path(directory).rglob("*"))
    target = files[0]
    raw = bytearray(target.read_bytes())
    if how == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        for i in range(len(raw) // 3, len(raw) // 3 + 16):
            raw[i] ^= 0xFF
    target.write_bytes(bytes(raw))


@pytest.mark.dist
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_context_checkpoint_resumed_plain_is_typed_and_leaves_the_model(tmp_path, how):
    run_world(_save_under_context, 2, str(tmp_path), timeout=300)
    _damage(tmp_path, how)
    model = _seq.user_lm(seed=1)
    opt = _seq.make_optim(model, "adamw")
    before = _snapshot(model)
    with pytest.raises(CheckpointError):
        ca.load_state(tmp_path, model, opt)
    assert _same(before, _snapshot(model))
    assert not opt.state  # nothing half-loaded into the optimizer either


def _mixtral_data():
    from zoo import moe

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, moe.VOCAB, (4, moe.SEQ + 1), generator=g)
    return DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=2)


def _mixtral_context_then_expert(rank, world, args):
    """Save a Mixtral trained under context 2; resume it under expert 2 (intact or damaged)."""
    from zoo import moe

    directory, phase = args
    if phase == "save":
        model = moe.build("mixtral")
        m, opt, data = _context_plan()(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _mixtral_data())
        _train(m, opt, data, steps=1)
        ca.save_state(directory, m, opt, data, step=1)
        return {k: v.numpy() for k, v in _snapshot(m).items()}
    model = moe.build("mixtral", seed=1)
    plan = ca.compose(ca.parallel_mode([("expert", 2), ("data", 1)]), ca.expert_parallel())
    m, opt, data = plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _mixtral_data())
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    kind, text = _outcome(ca.load_state, directory, m, opt, data)
    after = m.state_dict()
    untouched = all(torch.equal(before[k], after[k].detach()) for k in before)
    local = {k: v.detach().numpy().copy() for k, v in after.items()}
    return kind, text, untouched, local


@pytest.mark.dist
def test_context_checkpoint_resumed_under_expert_intact_and_damaged(tmp_path):
    saved = run_world(_mixtral_context_then_expert, 2, (str(tmp_path), "save"), timeout=400)[0]
    results = run_world(_mixtral_context_then_expert, 2, (str(tmp_path), "load"), timeout=400)
    for rank, (kind, text, _, local) in enumerate(results):  # intact: each rank holds its half of the experts
        assert kind == "ok", (kind, text)
        for name, value in local.items():
            whole = torch.from_numpy(saved[name])
            if ".experts." in name and value.shape != whole.shape:
                half = whole.shape[0] // 2
                whole = whole[rank * half : (rank + 1) * half]
            assert torch.equal(torch.from_numpy(value), whole), name
    _damage(tmp_path, "flip")
    for kind, text, untouched, _ in run_world(_mixtral_context_then_expert, 2, (str(tmp_path), "load"), timeout=400):
        assert kind == "CheckpointError" and untouched, (kind, text)

"""Checkpoints are verified: damaged or crafted files are typed errors naming the file, run no code,
and leave the live model and optimizer exactly as they were; a re-save never leaves no loadable copy."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.errors import CheckpointError, ConfigError
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state import files, verify
from composable_atorch.state import save as save_module
from composable_atorch.state.save import latest_checkpoint

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = pytest.mark.serial


def build(seed: int):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=16, d_model=16, n_layer=1, n_head=2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TextDataset(16, limit=16), batch_size=4, shuffle=True)
    return ca.compose()(model, optim, loader)


def train_steps(model, optim, loader, n: int):
    for _, (x, y) in zip(range(n), loader):
        optim.backward(lm_loss(model(x), y))
        optim.step()
        optim.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model, optim, loader = build(0)
    train_steps(model, optim, loader, 2)
    ca.save_state(root, model, optim, loader, step=2)
    return root, {k: v.clone() for k, v in model.state_dict().items()}


def fresh():
    """A model and optimizer to load into (other weights, no optimizer state yet) and their snapshot."""
    model, optim, loader = build(1)
    return model, optim, loader, {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model, optim, loader, before):
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optim.state and optim.micro_step == 0 and loader.batches_consumed == 0
    assert all(p.grad is None for p in model.parameters())


def test_an_intact_checkpoint_loads(saved):
    root, weights = saved
    model, optim, loader, _ = fresh()
    assert ca.load_state(root, model, optim, loader, verbose=False).step == 2
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def _files(root: Path) -> list[Path]:
    return sorted(p for p in latest_checkpoint(root).iterdir() if p.is_file())


def test_flipped_bits_and_truncations_are_typed_errors_naming_the_file(saved, tmp_path):
    root, _ = saved
    model, optim, loader, before = fresh()
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    checked = 0
    for path in _files(copy):
        original = path.read_bytes()
        size = len(original)
        damages = [original[: size // 2], original[:-1], b""]
        for offset in sorted({0, 1, size // 3, size // 2, size - 1}):
            flipped = bytearray(original)
            flipped[offset] ^= 0x10
            damages.append(bytes(flipped))
        for damaged in damages:
            path.write_bytes(damaged)
            with pytest.raises(CheckpointError) as err:
                ca.load_state(path.parent, model, optim, loader, verbose=False)
            assert path.name in str(err.value), str(err.value)
            assert_untouched(model, optim, loader, before)
            checked += 1
        path.write_bytes(original)
    assert checked >= 4 * 8
    assert ca.load_state(copy, model, optim, loader, verbose=False).step == 2  # restored: loads again


def _reseal(directory: Path, change) -> None:
    """Rewrite checkpoint.json as an attacker would: contents changed, manifest and checksum recomputed."""
    meta_path = directory / files.META
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta[verify.FILES] = verify.manifest(directory, skip=(files.META,))
    meta_path.write_text(json.dumps(verify.seal(meta)))


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m.update(step="3"), "step"),
        (lambda m: m.update(step=-1), "step"),
        (lambda m: m.update(world_size=0), "world_size"),
        (lambda m: m.pop("extra"), "extra"),
        (lambda m: m["optimizer"].update(group_sizes=["x"]), "optimizer.group_sizes"),
        (lambda m: m.update(loader=1), "loader"),
    ],
)
def test_checkpoint_json_fields_are_typed_and_ranged(saved, tmp_path, change, field):
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(latest_checkpoint(root), copy)
    _reseal(copy, change)
    model, optim, loader, before = fresh()
    with pytest.raises(CheckpointError, match=f"checkpoint.json: field '{field}'"):
        ca.load_state(copy, model, optim, loader, verbose=False)
    assert_untouched(model, optim, loader, before)


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_dcp_metadata_runs_no_code(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(latest_checkpoint(root), copy)
    marker = tmp_path / "pwned"
    (copy / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    _reseal(copy, lambda m: None)  # the checksums match: only the unpickler stands in the way
    model, optim, loader, before = fresh()
    with pytest.raises(CheckpointError, match=r"\.metadata.*names (posix|os)\.system"):
        ca.load_state(copy, model, optim, loader, verbose=False)
    assert not marker.exists()
    assert_untouched(model, optim, loader, before)
    # DCP's own byte items (stored with torch.save) are read as plain data, not unpickled freely
    buffer = io.BytesIO()
    torch.save(RunsCode(marker), buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        verify.safe_planner().load_bytes(None, buffer)
    assert not marker.exists()


def test_a_failing_dcp_read_leaves_model_and_optimizer_as_they_were(saved, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    root, _ = saved
    real = FileSystemReader.read_data

    def read_then_fail(self, plan, planner):
        real(self, plan, planner).wait()  # every tensor read: only staged copies may have changed
        raise CheckpointException("read_data", {0: RuntimeError("disk went away")})

    monkeypatch.setattr(FileSystemReader, "read_data", read_then_fail)
    model, optim, loader, before = fresh()
    with pytest.raises(CheckpointError, match="step-00000002.*disk went away"):
        ca.load_state(root, model, optim, loader, verbose=False)
    assert_untouched(model, optim, loader, before)
    # and with optimizer state already there, it stays exactly as it was
    train_steps(model, optim, loader, 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optim.optimizer.state.items()}
    with pytest.raises(CheckpointError):
        ca.load_state(root, model, optim, None, verbose=False)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for p, s in optim.optimizer.state.items():
        assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items())


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    model, optim, loader = build(0)
    for step in (1, 2, 3):
        train_steps(model, optim, loader, 1)
        ca.save_state(tmp_path, model, optim, loader, step=step)
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    shutil.rmtree(tmp_path / "step-00000003")
    assert latest_checkpoint(tmp_path).name == "step-00000002"
    (tmp_path / "step-00000002" / "__0_0.distcp").write_bytes(b"short")  # incomplete: wrong size
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    (tmp_path / files.LATEST).write_bytes(b"\x00garbage")
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    m, o, ld, _ = fresh()
    with pytest.warns(UserWarning, match="step-00000002 is damaged"):
        assert ca.load_state(tmp_path, m, o, ld, verbose=False).step == 1


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no cleanup, no except Exception)."""


def _resave_killed_at(kill_at: int, root: Path, model, optim, loader, monkeypatch) -> bool:
    """Save step 1 again into ``root``, "killed" at the ``kill_at``-th rename, pointer write or
    delete inside publishing; whether the save finished."""
    calls = {"n": 0, "publishing": False}

    def counting(fn):
        def wrapped(*args, **kwargs):
            calls["n"] += calls["publishing"]
            if calls["n"] == kill_at:
                raise Killed
            return fn(*args, **kwargs)

        return wrapped

    def publish(*args):
        calls["publishing"] = True  # kill points inside publish only (DCP wraps what it raises)
        return files.publish(*args)

    with monkeypatch.context() as patch:
        for name in ("replace", "rename"):
            patch.setattr(files.os, name, counting(getattr(os, name)))
        patch.setattr(files, "write_json", counting(files.write_json))
        patch.setattr(files.shutil, "rmtree", counting(shutil.rmtree))
        patch.setattr(save_module, "publish", publish)
        try:
            ca.save_state(root, model, optim, loader, step=1)  # the same step again
        except Killed:
            return False
    return True


def test_a_resave_killed_at_any_point_of_publishing_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    model, optim, loader = build(0)
    train_steps(model, optim, loader, 1)
    ca.save_state(tmp_path / "base", model, optim, loader, step=1)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, optim, loader, 1)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    seen_new = False
    for kill_at in range(1, 40):
        root = tmp_path / f"kill{kill_at}"
        shutil.copytree(tmp_path / "base", root)
        finished = _resave_killed_at(kill_at, root, model, optim, loader, monkeypatch)
        m, o, ld, _ = fresh()
        assert ca.load_state(root, m, o, ld, verbose=False).step == 1, f"kill point {kill_at}"
        loaded = m.state_dict()
        is_new = all(torch.equal(v, new[k]) for k, v in loaded.items())
        assert is_new or all(torch.equal(v, old[k]) for k, v in loaded.items())
        seen_new |= is_new
        # the next save finishes what the crash left
        ca.save_state(root, model, optim, loader, step=2)
        leftovers = [p.name for p in root.iterdir() if p.name.endswith((".resaved", ".old", ".partial"))]
        assert not leftovers and latest_checkpoint(root).name == "step-00000002"
        if finished:
            break
    assert finished and kill_at > 5 and seen_new


def test_load_errors_are_config_errors_for_old_callers(saved):
    assert issubclass(CheckpointError, ConfigError)  # `except ConfigError` keeps catching them


# -- loading the run's directory (latest.json): the damaged file and its checkpoint are named ------
def _shard(step_dir: Path) -> Path:
    return next(p for p in step_dir.iterdir() if p.suffix == ".distcp")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _foreign(path: Path) -> None:
    path.write_text(json.dumps({"format": "someone-else", "step": 2}))


DAMAGE = {  # kind -> (which file, what is done to it, what the error says)
    "missing shard": (_shard, os.remove, "missing"),
    "truncated shard": (_shard, _truncate, "truncated"),
    "corrupt shard": (_shard, _flip, "checksum differs"),
    "missing rank state": (lambda d: d / "rank-0.json", os.remove, "missing"),
    "corrupt metadata": (lambda d: d / ".metadata", _flip, "checksum differs"),
    "foreign checkpoint.json": (lambda d: d / files.META, _foreign, "field 'format'"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_to_the_checkpoint_to_load_names_the_file_the_checkpoint_and_its_step(saved, tmp_path, kind):
    root, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    which, damage, says = DAMAGE[kind]
    target = which(copy / "step-00000002")
    damage(target)
    model, optim, loader, before = fresh()
    with pytest.raises(CheckpointError) as err:
        ca.load_state(copy, model, optim, loader, verbose=False)  # the run's directory, as a restart loads it
    text = str(err.value)
    assert str(target) in text and says in text, text
    assert f"in checkpoint {copy / 'step-00000002'} (step 2)" in text and "nothing was loaded" in text, text
    assert "written by save_state" not in text  # it is a checkpoint, a damaged one
    assert_untouched(model, optim, loader, before)


def test_a_damaged_newest_checkpoint_is_named_while_the_previous_one_loads(tmp_path):
    model, optim, loader = build(0)
    for step in (1, 2):
        train_steps(model, optim, loader, 1)
        ca.save_state(tmp_path, model, optim, loader, step=step)
    shard = _shard(tmp_path / "step-00000002")
    _truncate(shard)
    m, o, ld, _ = fresh()
    with pytest.warns(UserWarning, match=f"step-00000002 is damaged .*{shard.name}.*loading .*step-00000001"):
        assert ca.load_state(tmp_path, m, o, ld, verbose=False).step == 1


def test_what_is_not_a_checkpoint_is_named_as_such(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"weights")
    model, optim, loader, before = fresh()
    for where, says in (
        (tmp_path / "absent", "does not exist"),
        (tmp_path / "hf", "holds no latest.json nor step-* checkpoint"),
        (tmp_path / "hf" / "model.safetensors", "a file, not a checkpoint directory"),
    ):
        with pytest.raises(ConfigError, match="written by save_state") as err:
            ca.load_state(where, model, optim, loader, verbose=False)
        assert str(where) in str(err.value) and says in str(err.value)
    assert_untouched(model, optim, loader, before)


# -- world 2: a flipped byte in an expert-parallel or a context-parallel checkpoint ---------------
def _parallel_run(kind: str):
    """(model, optim, loader, train one batch) at expert 2 or context 2, as test_reshard_* trains them."""
    import test_reshard_expert as ep
    import test_reshard_sequence as cp

    if kind == "expert":
        model = ep.mm.build("user")
        model, optim, loader = ep.PLANS["ep"]()(model, ep.OPTIMIZERS["adamw"](model.parameters()), ep.loader())
        return model, optim, loader, lambda b: ca.train_step(model, optim, b[1], b[1], ep.loss_fn)
    model = cp.model()
    model, optim, loader = cp.PLANS["context"]()(model, cp.OPTIMIZERS["adamw"](model.parameters()), cp.loader())
    return model, optim, loader, lambda b: ca.train_step(model, optim, b[1], b[2], cp.loss_fn)


def _local_state(model, optim) -> dict[str, torch.Tensor]:
    """This rank's weights and optimizer state (its own experts, its shards), copied."""
    out = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(optim.optimizer.state.values()):
        out.update({f"optim.{i}.{k}": v.detach().clone() for k, v in state.items() if torch.is_tensor(v)})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flipped_in_group(rank, world, directory):
    """Save step 1, train on, flip one byte of rank 1's shard, load: per kind, (error, unchanged, then
    with the byte put back: loads and changes the state)."""
    import torch.distributed as dist

    out = {}
    for kind in ("expert", "context"):
        model, optim, loader, train = _parallel_run(kind)
        batches = iter(loader)
        train(next(batches))
        where = Path(directory) / kind
        ca.save_state(where, model, optim, loader, step=1)
        train(next(batches))  # the live state differs from the checkpoint's
        before, consumed = _local_state(model, optim), loader.batches_consumed
        shard = where / "step-00000001" / "__1_0.distcp"
        original = shard.read_bytes()
        dist.barrier()
        if rank == 0:
            _flip(shard)
        dist.barrier()
        error = None
        try:
            ca.load_state(where, model, optim, loader, verbose=False)
        except CheckpointError as exc:
            error = str(exc)
        unchanged = _same(_local_state(model, optim), before) and loader.batches_consumed == consumed
        dist.barrier()
        if rank == 0:
            shard.write_bytes(original)
        dist.barrier()
        step = ca.load_state(where, model, optim, loader, verbose=False).step  # the intact one loads
        out[kind] = (str(shard), error, unchanged, step, not _same(_local_state(model, optim), before))
    return out


@pytest.mark.dist
def test_a_flipped_byte_in_an_expert_or_context_parallel_shard_is_named_at_world2_and_nothing_loads(tmp_path):
    from _dist import run_world

    per_rank = run_world(flipped_in_group, 2, str(tmp_path))
    for kind in ("expert", "context"):
        for rank, results in enumerate(per_rank):
            shard, error, unchanged, step, loaded_intact = results[kind]
            assert error is not None, (kind, rank)
            assert f"checkpoint file {shard}: its checksum differs" in error and "nothing was loaded" in error, error
            assert unchanged, (kind, rank)  # model, optimizer state and data position, by value
            assert step == 1 and loaded_intact, (kind, rank)  # the same load, byte restored, does change them

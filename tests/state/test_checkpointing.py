"""save_state / load_state: bitwise resume, crash safety, resharding, and typed errors.

The reference for every resume is the same run without interruption, compared with ``==`` on
losses and ``torch.equal`` on tensors: a resumed run must *be* the uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader, IterableDataset

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.errors import ConfigError
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state.save import latest_checkpoint
from composable_atorch.transforms.precision import GradScalerHook

from _dist import run_world

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = pytest.mark.serial

SCRIPTS = Path(__file__).parent.parent / "scripts"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def flat_state(model, optim) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors by name, as the scripts' safetensors references store them.

    For a ZeRO-1 optimizer: this rank's partition of the optimizer state.
    """
    inner = getattr(optim, "optimizer", optim)
    inner = getattr(inner, "optim", inner)
    model_sd, optim_sd = get_state_dict(model, [inner], options=FLAT)
    out = {f"model.{k}": v for k, v in model_sd.items()}
    out.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return out


def assert_same_state(mine: dict, ref: dict):
    assert set(mine) == set(ref)
    different = [k for k in ref if not torch.equal(mine[k], ref[k])]
    assert not different, f"tensors differ: {different[:5]}"


# -- world 1: amp fp16 (grad scaler) + accumulation, dropout, shuffled loader ------------------------
def build(plan=None, *, d_model=32, n_layer=2, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=d_model, n_layer=n_layer, n_head=2, dropout=0.1))
    optim = optimizer(model.parameters(), lr=1e-3)
    loader = DataLoader(TextDataset(16, limit=40), batch_size=8, shuffle=True)
    plan = ca.amp("fp16") | ca.accumulate(2) if plan is None else plan
    return plan(model, optim, loader)


def train(model, optim, loader, *, until: int, step: int = 0, save_at=None, directory=None):
    """Micro-batch losses from ``step`` to ``until``; stops right after saving at ``save_at``."""
    losses = []
    while step < until:
        for x, y in loader:
            loss = lm_loss(model(x), y)
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            step += 1
            if step == save_at:
                ca.save_state(directory, model, optim, loader, step=step, extra={"at": step})
                return losses
            if step >= until:
                break
    return losses


TOTAL = 16  # micro-batches of 4: 10 per epoch (40 samples), the optimizer steps every 2


@pytest.fixture(scope="module")
def uninterrupted():
    model, optim, loader = build()
    losses = train(model, optim, loader, until=TOTAL)
    return losses, flat_state(model, optim), next(optim.hook(GradScalerHook)).state_dict()


# 5: mid accumulation window, mid first epoch; 10: end of the first epoch; 13: mid window, mid second
# epoch (its shuffle must be replayed from the RNG state at the start of that pass)
@pytest.mark.parametrize("save_at", [5, 10, 13])
def test_world1_resume_is_bitwise_with_grad_scaler_and_accumulation(tmp_path, uninterrupted, save_at):
    ref_losses, ref_state, ref_scaler = uninterrupted
    model, optim, loader = build()
    before = train(model, optim, loader, until=TOTAL, save_at=save_at, directory=tmp_path)
    saved_scaler, saved_micro = next(optim.hook(GradScalerHook)).state_dict(), optim.micro_step

    model, optim, loader = build()
    step, extra = ca.load_state(tmp_path, model, optim, loader)
    assert (step, extra) == (save_at, {"at": save_at})
    assert optim.micro_step == saved_micro == save_at % 2
    assert next(optim.hook(GradScalerHook)).state_dict() == saved_scaler
    after = train(model, optim, loader, until=TOTAL, step=step)

    assert before + after == ref_losses
    assert_same_state(flat_state(model, optim), ref_state)
    assert next(optim.hook(GradScalerHook)).state_dict() == ref_scaler


def test_resume_without_the_data_position_differs(tmp_path, uninterrupted):
    """Control: the check above can fail — restoring weights alone does not reproduce the run."""
    model, optim, loader = build()
    before = train(model, optim, loader, until=TOTAL, save_at=4, directory=tmp_path)
    model, optim, _ = build()
    ca.load_state(tmp_path, model, optim)  # no loader: data position and shuffle not restored
    fresh = build()[2]
    after = train(model, optim, fresh, until=TOTAL, step=4)
    assert before + after != uninterrupted[0]


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([i])


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_continues_with_exactly_the_next_batch(tmp_path, workers):
    """Shuffled with a generator, across epochs, with a worker process: batches and RNG carry on."""

    def make():
        gen = torch.Generator().manual_seed(7)
        loader = DataLoader(Numbers(), batch_size=3, shuffle=True, generator=gen, num_workers=workers)
        return ca.resumable(loader)

    def draw(loader, passes):
        seen = []
        for _ in range(passes):
            seen += [b.flatten().tolist() + [torch.rand(()).item()] for b in loader]
        return seen

    torch.manual_seed(1)
    reference = draw(make(), 3)  # 4 batches per pass
    model = torch.nn.Linear(1, 1)
    for consumed in (0, 2, 4, 5):
        torch.manual_seed(1)
        loader, seen = make(), []
        it = iter(loader)
        for _ in range(consumed):
            if len(seen) and len(seen) % 4 == 0:
                it = iter(loader)
            seen.append(next(it).flatten().tolist() + [torch.rand(()).item()])
        ca.save_state(tmp_path / str(consumed), model, None, loader, step=consumed)
        resumed = make()
        ca.load_state(tmp_path / str(consumed), model, None, resumed)
        assert resumed.epoch == max(0, consumed - 1) // 4  # the epoch of the saved pass
        rest = draw(resumed, 1)
        if consumed and consumed % 4 == 0:  # the saved pass was complete: the next one starts
            assert rest == []
            rest = draw(resumed, 1)
        assert seen + rest == reference[: len(seen) + len(rest)], consumed


# -- typed errors, raised before anything is modified ------------------------------------------------
def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    model, optim, loader = build()
    train(model, optim, loader, until=TOTAL, save_at=2, directory=directory)
    return directory


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"d_model": 48}, "shape"),
        ({"n_layer": 1}, "not in the model: blocks.1"),
        ({"n_layer": 3}, "missing from the checkpoint: blocks.2"),
        ({"optimizer": torch.optim.Adam}, "optimizer class"),
    ],
)
def test_incompatible_model_or_optimizer_is_a_config_error_before_any_change(saved, kwargs, message):
    model, optim, loader = build(**kwargs)
    before = snapshot(model)
    with pytest.raises(ConfigError, match=message):
        ca.load_state(saved, model, optim, loader)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optim.state and optim.micro_step == 0 and loader.batches_consumed == 0


def test_optimizer_hooks_that_would_lose_state_are_refused(saved):
    model, optim, loader = build(ca.compose())  # no amp: the saved grad scaler state has no home
    with pytest.raises(ConfigError, match="GradScalerHook"):
        ca.load_state(saved, model, optim, loader)
    assert not optim.state


def test_missing_or_foreign_directories_are_config_errors(tmp_path):
    model, optim, loader = build()
    for where in (tmp_path / "absent", tmp_path):
        with pytest.raises(ConfigError, match="written by save_state"):
            ca.load_state(where, model, optim, loader)


def test_bad_save_arguments_write_nothing(tmp_path):
    model, optim, loader = build()
    plain = DataLoader(TextDataset(16, limit=8), batch_size=4)
    bad = [
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"step": 1, "extra": {"x": object()}}, "extra"),
        ({"step": 1, "keep": 0}, "keep"),
        ({"step": 1, "loader": plain}, "resumable"),
    ]
    for kwargs, message in bad:
        kwargs = {"loader": loader, **kwargs}
        with pytest.raises(ConfigError, match=message):
            ca.save_state(tmp_path / "ckpt", model, optim, **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_iterable_datasets_cannot_be_resumed():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ConfigError, match="map-style"):
        ca.resumable(DataLoader(Stream(), batch_size=2))


def test_keep_prunes_old_checkpoints(tmp_path):
    model, optim, loader = build()
    for step in (2, 4, 6):
        train(model, optim, loader, until=TOTAL, step=step - 2, save_at=step, directory=tmp_path)
    ca.save_state(tmp_path, model, optim, loader, step=8, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000008"]
    assert latest_checkpoint(tmp_path).name == "step-00000008"


# -- crash safety: SIGKILL in the middle of a save -----------------------------------------------------
def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    points = ("data", "publish", "pointer")
    procs = {}
    for point in points:
        (tmp_path / point).mkdir()
        cmd = [
            sys.executable,
            str(SCRIPTS / "crash_during_save.py"),
            str(tmp_path / point / "ckpt"),
            str(tmp_path / point),
            point,
        ]
        procs[point] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    for point, proc in procs.items():
        output = proc.communicate(timeout=120)[0].decode()
        assert proc.returncode == -signal.SIGKILL, f"{point}: {output}"

    for point in points:
        ckpt = tmp_path / point / "ckpt"
        assert latest_checkpoint(ckpt).name == "step-00000002", point
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))
        model, optim, loader = ca.compose()(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            DataLoader(TextDataset(16, limit=32), batch_size=4, shuffle=True),
        )
        assert ca.load_state(ckpt, model, optim, loader).step == 2
        assert_same_state(flat_state(model, optim), load_file(tmp_path / point / "step2.safetensors"))
        # the next save clears what the crash left and publishes normally
        ca.save_state(ckpt, model, optim, loader, step=3)
        assert latest_checkpoint(ckpt).name == "step-00000003"
        assert not list(ckpt.glob(".*.partial")) and not list(ckpt.glob(".*.old"))


# -- world 2, fsdp: SIGKILL mid-training and resume; reshard 2 -> 1 ----------------------------------
def launch(tmp: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nproc", "2", str(SCRIPTS / "train_resumable.py")]
    cmd += ["--ckpt", str(tmp / "ckpt"), "--out", str(tmp / "out"), "--steps", "10", "--save-every", "4", *args]
    (tmp / "out").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out = proc.communicate(timeout=timeout)[0].decode()
    return out[-3000:]


def losses(out: Path, rank: int) -> list[tuple[int, float]]:
    lines = (out / f"losses-rank{rank}.jsonl").read_text().splitlines()
    return [(d["step"], d["loss"]) for d in map(json.loads, lines)]


@pytest.fixture(scope="module")
def world2_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = launch(tmp, "--full-state")
    log = finish(proc)
    assert proc.returncode == 0, log
    return tmp


@pytest.mark.dist
def test_sigkill_and_resume_reproduce_the_uninterrupted_losses_bitwise(tmp_path, world2_reference):
    proc = launch(tmp_path, "--pause-after", "9")  # checkpoints at steps 4 and 8; killed after step 9
    pid_files = [tmp_path / "out" / f"pid-rank{r}" for r in (0, 1)]
    deadline = time.monotonic() + 240
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 10)
        time.sleep(0.2)
    for p in pid_files:
        os.kill(int(p.read_text()), signal.SIGKILL)
    log = finish(proc)
    assert proc.returncode != 0 and "SIGKILL" in log, log
    assert latest_checkpoint(tmp_path / "ckpt").name == "step-00000008"

    proc = launch(tmp_path, "--full-state")  # resumes from step 8
    log = finish(proc)
    assert proc.returncode == 0, log
    for rank in (0, 1):
        reference = losses(world2_reference / "out", rank)
        run = losses(tmp_path / "out", rank)
        # killed run: steps 1..9; resumed run: steps 9..10 (step 9's work was lost with the kill)
        assert [s for s, _ in run] == [*range(1, 10), 9, 10]
        assert run[:9] + run[10:] == reference
        assert run[9] == reference[8]
    assert_same_state(
        load_file(tmp_path / "out" / "full-step-10.safetensors"),
        load_file(world2_reference / "out" / "full-step-10.safetensors"),
    )


@pytest.mark.dist
def test_a_rank_sigkilled_while_an_asynchronous_save_writes_leaves_the_last_complete_checkpoint(tmp_path):
    """fsdp at world 2 saving asynchronously at steps 4 and 8; rank 1 SIGKILLs itself 0, 20 and 200 ms
    after the save call of step 8 (the three jobs run side by side). The newest complete checkpoint
    opens exactly (model and AdamW state equal to what the ranks held at that step); the partial
    one is ignored. At 0 ms the writer cannot have finished: step 4 is the one that opens."""
    delays = (0, 20, 200)
    procs = {
        ms: launch(tmp_path / f"{ms}ms", "--asynchronous", "--full-state", "--kill-after-save", f"8:{ms}")
        for ms in delays
    }
    opened = {}
    for ms, proc in procs.items():
        log = finish(proc)
        assert proc.returncode != 0 and "exitcode: -9" in log, (ms, log)
        ckpt = tmp_path / f"{ms}ms" / "ckpt"
        latest = latest_checkpoint(ckpt)
        assert latest is not None and latest.name in ("step-00000004", "step-00000008"), (ms, list(ckpt.iterdir()))
        step = int(latest.name[5:])
        if ms == 0:
            assert step == 4 and (ckpt / ".step-00000008.partial").is_dir(), list(ckpt.iterdir())
        torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
        model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2, dropout=0.1))
        optim = torch.optim.AdamW(model.parameters(), lr=1.0)
        assert ca.load_state(ckpt, model, optim).step == step
        want = load_file(tmp_path / f"{ms}ms" / "out" / f"full-step-{step}.safetensors")
        assert_same_state(flat_state(model, optim), want)
        opened[ms] = (step, sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".partial")))
    print(f"\nrank 1 SIGKILLed after the save call of step 8: {opened} (ms: step opened, partial left)")


@pytest.mark.dist
def test_a_world2_fsdp_checkpoint_loads_in_one_process(world2_reference):
    torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2, dropout=0.1))
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    step, extra = ca.load_state(world2_reference / "ckpt" / "step-00000008", model, optim)
    assert (step, extra) == (8, {"note": "saved at 8"})
    assert_same_state(flat_state(model, optim), load_file(world2_reference / "out" / "full-step-8.safetensors"))
    assert optim.param_groups[0]["lr"] == 3e-3


# -- world 2 in one spawned group: ddp, zero1 (ZeRO's local partitions), zero2 ----------------------
PLANS = {"ddp": lambda: ca.ddp(), "zero1": lambda: ca.ddp() | ca.zero1(), "zero2": lambda: ca.zero2()}


def resume_in_group(rank, world, directory):
    """Per plan: (resumed losses, uninterrupted losses, this rank's state at the save)."""
    out = {}
    for name, plan in PLANS.items():
        reference = train(*build(plan()), until=TOTAL)
        model, optim, loader = build(plan())
        before = train(model, optim, loader, until=TOTAL, save_at=6, directory=f"{directory}/{name}")
        # numpy arrays travel back by value (torch tensors would be shared through the exiting child)
        at_save = (
            {k: v.detach().clone().numpy() for k, v in flat_state(model, optim).items()} if name == "zero1" else None
        )
        model, optim, loader = build(plan())
        step, _ = ca.load_state(f"{directory}/{name}", model, optim, loader)
        out[name] = (before + train(model, optim, loader, until=TOTAL, step=step), reference, at_save)
    return out


@pytest.mark.dist
def test_ddp_zero1_zero2_resume_bitwise_and_zero1_reshards_to_one_process(tmp_path):
    per_rank = run_world(resume_in_group, 2, str(tmp_path))
    for results in per_rank:
        for name, (resumed, reference, _) in results.items():
            assert resumed == reference, name
    # ZeRO-1: each rank saved its own partition of the optimizer state; one process reads them all
    partitions = [{k: torch.from_numpy(v) for k, v in results["zero1"][2].items()} for results in per_rank]
    assert not set(k for k in partitions[0] if k.startswith("optim.")) & set(
        k for k in partitions[1] if k.startswith("optim.")
    )
    whole = {**partitions[0], **partitions[1]}
    model, optim, _ = build(ca.compose())
    assert ca.load_state(tmp_path / "zero1", model, optim).step == 6
    assert_same_state(flat_state(model, optim), whole)

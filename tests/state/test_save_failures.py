"""A save that cannot be written (a full disk) is a typed error on every rank, naming the directory
and the cause, and nothing is lost: the previous checkpoint stays the one load_state opens (by value),
the partial copy is removed, training goes on, and the next save once space is freed is complete.

The disk fills for real where the machine lets the test mount a size-limited tmpfs (root on Linux):
a ballast file leaves half a checkpoint of room. Elsewhere DCP's own file writes raise
OSError(ENOSPC) once a byte budget is spent (a stand-in: our JSON files are not limited then).
At world 2 one rank's write failing alone (its disk full, the other's not) must not leave the other
waiting: DCP's data, a rank's own rank-N.json, rank 0's checkpoint.json and latest.json are each
made to fail on one rank, and both ranks raise the same error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist
from test_async_save import assert_equal, build, loaded, state_of, step
from torch.distributed.checkpoint.filesystem import FileSystem

import composable_atorch as ca
from composable_atorch.errors import CheckpointWriteError
from composable_atorch.models import Block
from composable_atorch.state import files, writes
from composable_atorch.state import save as save_module
from composable_atorch.state.inflight import SaveInFlight

from _dist import run_world

STEP1, STEP2 = "step-00000001", "step-00000002"


# -- a disk that fills ------------------------------------------------------------------------------
def mount_tmpfs(path: Path) -> bool:
    """A 64 MiB tmpfs at ``path`` if this machine lets the test mount one (root, Linux)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def disk(tmp_path):
    """(directory to save into, whether it is a real size-limited tmpfs)."""
    path = tmp_path / "disk"
    real = mount_tmpfs(path)
    yield path, real
    if real:
        subprocess.run(["umount", str(path)], check=True)


class Budgeted:
    """A DCP data stream that raises OSError(ENOSPC) once the process's byte budget is spent."""

    left: float = float("inf")

    def __init__(self, raw, path):
        self.raw, self.path = raw, path

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > Budgeted.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        Budgeted.left -= size
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


@contextlib.contextmanager
def _budgeted_stream(self, path, mode):
    with open(path, mode) as raw:
        yield Budgeted(raw, path)


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def fill(directory: Path, real: bool, leave: int, rank: int = 0) -> None:
    """Leave ``leave`` bytes of room: a ballast file on the tmpfs (rank 0), or each rank's share as its budget."""
    if not real:
        Budgeted.left = leave // (dist.get_world_size() if dist.is_initialized() else 1)
    elif rank == 0:
        free = shutil.disk_usage(directory).free
        with open(directory / "ballast", "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, free - leave))


def free_up(directory: Path, real: bool, rank: int = 0) -> None:
    Budgeted.left = float("inf")
    if real and rank == 0:
        (directory / "ballast").unlink(missing_ok=True)


def assert_nothing_left_over(directory: Path) -> None:
    names = [p.name for p in directory.iterdir()]
    assert not [n for n in names if n.endswith((".partial", ".tmp", ".resaved", ".old"))], names


def assert_names_the_cause(err: CheckpointWriteError, directory: Path, step_: int) -> None:
    text = str(err)
    assert f"saving step {step_} into {directory} failed: no space left on device" in text, text
    assert err.errno == errno.ENOSPC and err.latest == str(directory / STEP1), text
    assert f"{directory / STEP1} is still the latest checkpoint, the one load_state opens" in text, text
    assert "free space on the filesystem" in text and "training can go on" in text, text


# -- world 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_is_a_typed_error_the_previous_checkpoint_loads_and_the_next_save_works(
    disk, monkeypatch, asynchronous
):
    directory, real = disk
    if not real:
        monkeypatch.setattr(FileSystem, "create_stream", _budgeted_stream)
    model, optim, loader = build()
    batches = iter(loader)
    step(model, optim, batches)
    at_1 = state_of(model, optim)
    ca.save_state(directory, model, optim, loader, step=1, asynchronous=asynchronous)
    ca.wait_for_saves()
    fill(directory, real, leave=checkpoint_bytes(directory / STEP1) // 2)

    step(model, optim, batches)
    if asynchronous:
        pending = ca.save_state(directory, model, optim, loader, step=2, asynchronous=True)
        assert isinstance(pending, SaveInFlight)
        step(model, optim, batches)  # training goes on while the write fails
        with pytest.raises(CheckpointWriteError) as err:  # surfaced by the next save, which does not run
            ca.save_state(directory, model, optim, loader, step=3, asynchronous=True)
        assert ca.wait_for_saves() is None  # raised once
    else:
        with pytest.raises(CheckpointWriteError) as err:
            ca.save_state(directory, model, optim, loader, step=2)
    assert_names_the_cause(err.value, directory, 2)
    assert err.value.needed_bytes > checkpoint_bytes(directory / STEP1) // 2
    assert_nothing_left_over(directory)
    assert files.latest_checkpoint(directory).name == STEP1 and not (directory / STEP2).exists()
    assert_equal(loaded(directory), at_1)

    step(model, optim, batches)  # training goes on; once space is freed, the next save is complete
    at_now = state_of(model, optim)
    free_up(directory, real)
    ca.save_state(directory, model, optim, loader, step=4, asynchronous=asynchronous)
    ca.wait_for_saves()
    assert files.latest_checkpoint(directory).name == "step-00000004"
    assert_nothing_left_over(directory)
    assert_equal(loaded(directory), at_now)
    assert_equal(loaded(directory / STEP1), at_1)


# -- world 2 ----------------------------------------------------------------------------------------
def _one_rank_fails(where: str):
    """A patch making ``where``'s write fail with ENOSPC on this rank: DCP's data stream, or one JSON file."""
    if where == "data":
        Budgeted.left = 0
        return mock.patch.object(FileSystem, "create_stream", _budgeted_stream)
    module = {"rank-1.json": save_module, files.META: writes, files.LATEST: files}[where]
    real = module.write_json

    def write_json(path, data):
        if Path(path).name == where:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    return mock.patch.object(module, "write_json", write_json)


#: scenario -> (asynchronous, the rank whose write fails alone and which write, or None for the full disk)
SCENARIOS = {
    "full disk": (False, None),
    "full disk, asynchronous": (True, None),
    "rank 1's data": (False, (1, "data")),
    "rank 1's data, asynchronous": (True, (1, "data")),
    "rank 1's rank-1.json": (False, (1, "rank-1.json")),
    "rank 0's checkpoint.json": (False, (0, files.META)),
    "rank 0's latest.json": (False, (0, files.LATEST)),
}


def fail_in_group(rank, world, root, real):
    """Each scenario in its own directory, fsdp at world 2: save step 1, fail step 2, train on, save again."""
    out = {}
    for name, (asynchronous, alone) in SCENARIOS.items():
        directory = Path(root) / name.replace(" ", "_").replace("'", "").replace(",", "")
        model, optim, loader = build(ca.compose(ca.fsdp(wrap=(Block,))))
        batches = iter(loader)
        step(model, optim, batches)
        at_1 = state_of(model, optim)
        ca.save_state(directory, model, optim, loader, step=1)
        patch = contextlib.nullcontext()
        if alone is None:
            fill(directory, real, checkpoint_bytes(directory / STEP1) // 2, rank)
            patch = (
                contextlib.nullcontext() if real else mock.patch.object(FileSystem, "create_stream", _budgeted_stream)
            )
        elif alone[0] == rank:
            patch = _one_rank_fails(alone[1])
        dist.barrier()
        step(model, optim, batches)
        error = None
        with patch:
            try:
                ca.save_state(directory, model, optim, loader, step=2, asynchronous=asynchronous)
                step(model, optim, batches)  # training goes on while the write fails
                ca.wait_for_saves()
            except CheckpointWriteError as exc:
                error = (str(exc), exc.errno, exc.latest, exc.needed_bytes)
        assert error is not None, name
        dist.barrier()  # rank 0 removed the partial copy; the test looks at the directory
        left = sorted(p.name for p in directory.iterdir() if p.name != "ballast")
        step(model, optim, batches)
        at_now = state_of(model, optim)
        free_up(directory, real, rank)
        dist.barrier()
        ca.save_state(directory, model, optim, loader, step=4, asynchronous=asynchronous)
        ca.wait_for_saves()
        out[name] = {"error": error, "left": left, "at_1": at_1, "at_now": at_now, "dir": str(directory)}
    return out


@pytest.mark.dist
def test_a_failed_write_on_any_rank_is_the_same_typed_error_on_every_rank_and_nothing_is_lost(tmp_path):
    root = tmp_path / "disk"
    real = mount_tmpfs(root)
    try:
        per_rank = run_world(fail_in_group, 2, str(root), real, timeout=240)  # a rank left waiting: a timeout
        for name, (_, alone) in SCENARIOS.items():
            mine, theirs = per_rank[0][name], per_rank[1][name]
            directory = Path(mine["dir"])
            assert mine["error"] == theirs["error"], name  # the same error, word for word
            text, code, latest, needed = mine["error"]
            assert f"saving step 2 into {directory} failed: no space left on device" in text, (name, text)
            assert code == errno.ENOSPC and latest == str(directory / STEP1), (name, text)
            if alone is not None:
                assert f"rank {alone[0]}: OSError: [Errno 28]" in text, (name, text)
            if alone is None or alone[1] == "data":
                assert needed, (name, text)  # what DCP planned to write, every rank's
            assert mine["left"] == ["latest.json", STEP1], (name, mine["left"])  # no partial copy, no step 2
            assert_equal(loaded(directory / STEP1), mine["at_1"])
            assert files.latest_checkpoint(directory).name == "step-00000004", name
            assert_equal(loaded(directory), mine["at_now"])
            assert_nothing_left_over(directory)
    finally:
        if real:
            subprocess.run(["umount", str(root)], check=True)

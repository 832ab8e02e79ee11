"""Asynchronous save: ``save_state(..., asynchronous=True)`` returns once the tensors are staged.

What is asynchronous, and why it is safe
    DCP's ``async_save`` copies (stages) the state dict into CPU memory on the caller's thread
    and writes the files on a background thread; training may change the weights right after
    ``save_state`` returns. Here, the background thread then finishes the save exactly as a
    blocking one does: every rank's files fsynced, rank 0 writes the manifest (sizes and
    checksums) and publishes atomically (files.publish), old checkpoints are pruned. A crash
    during the write leaves the previous complete checkpoint, as with a blocking save.

Never lost
    At most one save is in flight per process. The next ``save_state`` (either kind) and
    ``load_state`` wait for it first; :func:`wait_for_saves` (``composable_atorch.wait_for_saves``)
    waits explicitly and re-raises its failure; the thread is not a daemon, so the interpreter
    finishes it before exiting, and an ``atexit`` hook reports a failure nobody waited for. A
    write that failed (a full disk, on any rank) is the same CheckpointWriteError a blocking save
    raises (writes.py), on every rank, raised by whichever of these comes first; nothing of it
    was published and the next save starts afresh.
    Call ``wait_for_saves()`` before ``dist.destroy_process_group()``: the write's collectives
    need the group.

Why a second process group
    The write's collectives (DCP's planning and the publish agreements) run on the background
    thread while training runs its own collectives on the main one. Two threads issuing
    collectives on one gloo group interleave them; the save uses a gloo group of its own,
    created once per default group (every rank creates it in the same save_state call).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

_pending: SaveInFlight | None = None
_groups: list = []  # [(the default group, the save group)] of the current process group


class SaveInFlight(os.PathLike):
    """A save still being written: ``.path`` (the checkpoint it publishes), ``.done()``, ``.wait()``.

    It is a path-like of the checkpoint's final directory (as the blocking ``save_state`` returns),
    complete once ``wait()`` returns.
    """

    def __init__(self, path: Path, work: Callable[[], None]):
        self.path, self._error = Path(path), None
        self._thread = threading.Thread(target=self._run, args=(work,), name="composable_atorch-save")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - kept, re-raised by wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is published; re-raise what failed the write, if anything did."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "published" if self.done() else "writing"
        return f"SaveInFlight({str(self.path)!r}, {state})"


def start(path: Path, work: Callable[[], None]) -> SaveInFlight:
    """Run ``work`` (wait for DCP's write, then publish: save.py) on the save thread."""
    global _pending
    _pending = SaveInFlight(path, work)
    return _pending


def wait_for_saves() -> Path | None:
    """Wait for the save in flight (if any) to be published; re-raise its failure.

    ``save_state`` and ``load_state`` call it first; call it before destroying the process group.
    Returns the checkpoint that was being written, or None when none was.
    """
    global _pending
    pending, _pending = _pending, None
    return None if pending is None else pending.wait()


#: "thread" (DCP's default) or "process" (DCP's checkpoint daemon process: its writes hold no GIL of
#: the training process); "process" needs a process group (benchmarks/save_stall.py compares them)
CHECKPOINTER = "thread"


def checkpointer_type():
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if CHECKPOINTER == "process" and dist.is_available() and dist.is_initialized():
        return AsyncCheckpointerType.PROCESS
    return AsyncCheckpointerType.THREAD


def save_group():
    """The gloo group the background writes use (None without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if not _groups or _groups[0][0] is not world:
        _groups[:] = [(world, dist.new_group(backend="gloo"))]
    return _groups[0][1]


@atexit.register
def _report_at_exit() -> None:
    """The thread was finished by the interpreter (not a daemon); a failure nobody saw is said."""
    pending = _pending
    if pending is not None:
        pending._thread.join()
        if pending._error is not None:
            print(
                f"composable_atorch: the asynchronous save of {pending.path} failed: {pending._error!r}",
                file=sys.stderr,
                flush=True,
            )

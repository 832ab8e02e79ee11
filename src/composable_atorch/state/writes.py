"""A save's writes, and how one failing on any rank fails the save alike on every rank.

What can fail
    A disk fills up, a quota is hit, a directory is not writable, a network filesystem goes
    away: DCP's data files (every rank), its ``.metadata`` and ``checkpoint.json`` (rank 0), a
    rank's ``rank-N.json``, the rename into place. DCP gathers its own ranks' write failures and
    raises them on every rank, as a ``CheckpointException`` (a BaseException that names no
    directory); a failure writing our own files is one rank's alone.

Why every rank agrees
    A rank raising alone would leave the others waiting in the save's next collective (until the
    collective timeout, then an error naming nothing). So each phase of a save (preparing the
    directory; writing the files; publishing) ends in :meth:`Writes.agree`, an all-gather of what
    failed on each rank, in place of the barrier the phase needs anyway. When anything failed,
    every rank raises the same :class:`~composable_atorch.errors.CheckpointWriteError`, built
    from the same gathered list, after rank 0 removed the partial directory (every rank has
    stopped writing by then). Nothing was published: ``latest.json`` still names the previous
    checkpoint, and the next save starts afresh once the cause is fixed.

Why the cause survives
    torch.save, which DCP uses for its non-tensor items, turns the OSError of a full disk into a
    RuntimeError ("unexpected pos"), keeping the OSError only as ``__context__``, which does not
    survive the pickling by which DCP gathers failures across ranks. :class:`Writer` raises the
    first OSError of the chain instead, so its errno (ENOSPC, EDQUOT, ...) reaches every rank.
"""

from __future__ import annotations

import errno as errnos
import functools
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from composable_atorch.errors import CheckpointWriteError
from composable_atorch.state import verify
from composable_atorch.state.files import META, latest_checkpoint, partial_dir, recover, write_json

#: the errnos of a filesystem without room: the fix is to free space
FULL = (errnos.ENOSPC, errnos.EDQUOT, errnos.EFBIG)
#: the errnos of a directory this process may not write
DENIED = (errnos.EACCES, errnos.EPERM, errnos.EROFS)


@dataclass(frozen=True)
class Failure:
    """One rank's failed write, as plain data (it travels to every rank)."""

    rank: int
    errno: int | None
    text: str

    @staticmethod
    def of(rank: int, exc: BaseException) -> Failure:
        found = os_error(exc)
        try:
            said = f"{type(exc).__name__}: {exc}"
        except Exception:  # noqa: BLE001 - an exception whose str() fails (a malformed DCP one) is named by repr
            said = repr(exc)
        return Failure(rank, getattr(found, "errno", None), said[:400])


def os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``'s chain (itself, its cause or context), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def dcp_failures(exc) -> list[Failure]:
    """A DCP ``CheckpointException``'s failures (``{rank: (exception, traceback)}``), one per rank."""
    failures = getattr(exc, "failures", None) or {}
    out = []
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if getattr(inner, "failures", None):  # DCP's exception raised inside DCP: its own failures
            out.extend(dcp_failures(inner))
        elif isinstance(inner, BaseException):
            out.append(Failure.of(rank, inner))
        else:
            out.append(Failure(rank, None, str(inner)[:400]))
    return out or [Failure(-1, None, str(exc)[:400])]


@functools.cache
def _item_overhead() -> tuple[int, int]:
    """What torch.save adds around each item DCP writes (it saves every tensor and value on its own):
    (around a tensor's bytes, a plain value's whole size); about 1.5 KB each, most of a small model's
    checkpoint."""
    import io

    import torch

    sizes = []
    for value in (torch.zeros(0), 0.0):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        sizes.append(len(buffer.getvalue()))
    return sizes[0], sizes[1]


def _planned_bytes(plan) -> int:
    """About the bytes a DCP save plan writes: tensor chunks at their dtype's size, each item as torch.save
    frames it."""
    tensor_frame, value_size = _item_overhead()
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            total += math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
            total += tensor_frame
        else:
            total += item.bytes_io_data.nbytes if item.bytes_io_data is not None else value_size
    return total


@functools.cache
def _writer_class():
    """DCP's FileSystemWriter, built on first use (importing DCP takes about a second)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        """FileSystemWriter that keeps the bytes it was planned to write and raises a failed write's
        OSError itself (see the module docstring)."""

        planned: int | None = None

        def write_data(self, plan, planner):
            self.planned = _planned_bytes(plan)
            try:
                return super().write_data(plan, planner)
            except Exception as exc:
                raise (os_error(exc) or exc) from None

        def finish(self, metadata, results) -> None:
            try:
                super().finish(metadata, results)
            except Exception as exc:
                raise (os_error(exc) or exc) from None

    Writer.__module__, Writer.__qualname__ = __name__, "Writer"
    return Writer


def __getattr__(name: str):
    """``writes.Writer``: pickled by name when DCP's checkpoint process writes, so found here."""
    if name == "Writer":
        return _writer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Writes:
    """One save's writes on this rank: the failures met so far, and all ranks' agreement on them."""

    def __init__(self, root: Path, step: int, rank: int):
        self.root, self.step, self.rank = root, step, rank
        self.partial = partial_dir(root, step)
        self.failures: list[Failure] = []
        self.writer = _writer_class()(self.partial, sync_files=True)

    def attempt(self, write) -> None:
        """Run ``write()`` unless a write of this rank already failed; a failure is kept for :meth:`agree`."""
        from torch.distributed.checkpoint.api import CheckpointException

        if self.failures:
            return
        try:
            write()
        except CheckpointException as exc:  # a BaseException: DCP's, the same on every rank
            self.failures = dcp_failures(exc)
        except OSError as exc:
            self.failures = [Failure.of(self.rank, exc)]

    def agree(self, group=None) -> None:
        """Collective (every rank calls it at the same point of the save, on ``group``): when a write
        failed on any rank, the same CheckpointWriteError on every rank, rank 0 cleaning up first."""
        mine = (self.failures, self.writer.planned)
        everyone = [mine]
        if dist.is_available() and dist.is_initialized():
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
        unique = {(f.rank, f.text): f for failures, _ in everyone for f in failures}
        if not unique:
            return
        planned = [p for _, p in everyone]
        needed = sum(planned) if all(p is not None for p in planned) else None
        if self.rank == 0:
            shutil.rmtree(self.partial, ignore_errors=True)  # every rank stopped writing: the gather says so
        raise write_error(self.root, self.step, [unique[k] for k in sorted(unique)], needed)

    def finish(self, meta: dict | None, keep: int | None, group, publish) -> None:
        """Once every rank's files are written: rank 0 seals the manifest and ``publish``-es
        (save.py's, renaming into place and moving latest.json); an agreement before and after."""
        self.agree(group)
        if meta is not None:

            def seal_and_publish() -> None:
                meta[verify.FILES] = verify.manifest(self.partial, skip=(META, f"{META}.tmp"))
                write_json(self.partial / META, verify.seal(meta))
                publish(self.root, self.partial, self.step, keep)

            self.attempt(seal_and_publish)
        self.agree(group)


def prepare(root: Path, partial: Path) -> None:
    """Rank 0, before any rank writes: the directory, what a crashed save left cleared, an empty partial one."""
    root.mkdir(parents=True, exist_ok=True)
    recover(root)  # finish a re-save a crash interrupted, before this save adds its own
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()


def write_error(root: Path, step: int, failures: list[Failure], needed: int | None) -> CheckpointWriteError:
    """The error every rank raises: the directory, the cause (the first errno met), each rank's failure."""
    code = next((f.errno for f in failures if f.errno is not None), None)
    cause = os.strerror(code).lower() if code is not None else "a write failed"
    said = "; ".join(f"rank {f.rank}: {f.text}" for f in failures[:4])
    size = "" if needed is None else f"; this checkpoint writes about {needed} bytes ({needed / 2**20:.1f} MiB)"
    latest = latest_checkpoint(root)
    kept = (
        f"{latest} is still the latest checkpoint, the one load_state opens"
        if latest is not None
        else f"{root} holds no complete checkpoint yet"
    )
    problem = f"{cause} ({said}){size}; nothing was published: the partial copy was removed and {kept}"
    if code in FULL:
        fix = f"free space on the filesystem of {root} (keep= prunes old checkpoints) or save to another directory"
    elif code in DENIED:
        fix = f"make {root} writable by every rank, or save to another directory"
    else:
        fix = f"make {root} writable by every rank (the cause above)"
    fix += "; training can go on, and the next save_state writes a complete checkpoint"
    return CheckpointWriteError(
        root, step, problem, fix, errno=code, needed_bytes=needed, latest=None if latest is None else str(latest)
    )

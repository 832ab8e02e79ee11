"""The on-disk layout of checkpoints, and how one becomes visible atomically.

    ckpt/
      latest.json              {"checkpoint": "step-00000100", ...}: the newest complete one
      step-00000100/           DCP's files, rank-N.json per rank, checkpoint.json
      .step-00000104.partial/  a save in progress (or one a crash interrupted)
      step-00000100.resaved/   a complete re-save of step 100 while it replaces the old copy

A save writes everything into the ``.partial`` directory and fsyncs it; :func:`publish` then
renames it into place and only after that moves ``latest.json`` (written to a temporary name,
fsynced, ``os.replace``-d). A crash at any point therefore leaves ``latest.json`` naming a
complete checkpoint. Everything here is JSON: nothing is pickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from composable_atorch.core import untrusted
from composable_atorch.errors import CompositionError, ConfigError
from composable_atorch.state import verify

FORMAT = "composable_atorch.checkpoint"
#: 2: checkpoint.json lists every file with its size and blake2b digest and carries its own digest
VERSION = 2
LATEST = "latest.json"
META = "checkpoint.json"
#: the suffix of a re-saved step while it replaces the old copy
RESAVED = ".resaved"
_STEP = re.compile(r"step-\d{8}")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{checkpoint_name(step)}.partial"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write, flush and fsync; through a temporary name and os.replace, so readers see all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # a full disk: what was written of the temporary file goes, the old file stays
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def check_jsonable(value: Any, where: str) -> Any:
    """``value`` itself if JSON can hold it; ConfigError naming ``where`` otherwise."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            where, type(value).__name__, f"JSON values (dicts with string keys, lists, numbers, strings): {exc}"
        ) from None
    return value


def _pointer_target(root: Path) -> Path | None:
    """The directory latest.json names, or None when the pointer is absent or unreadable."""
    try:
        data = json.loads(untrusted.read_regular_file(root / LATEST, "latest checkpoint pointer", limit=1 << 16))
    except (CompositionError, ValueError, UnicodeDecodeError):
        return None
    name = data.get("checkpoint") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name.startswith("step-") or "/" in name or os.sep in name:
        return None
    return root / name


def complete(path: Path) -> dict[str, Any] | None:
    """checkpoint.json of ``path`` if it is valid and every file it lists is present at its size."""
    return verify.looks_complete(path, META, FORMAT, VERSION)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory`` (what load_state would load), or None.

    ``directory`` may also be one ``step-*`` checkpoint itself. When latest.json is missing,
    damaged, or names a checkpoint that is gone or incomplete (a crash between two renames of a
    re-save, a deleted directory), the newest complete ``step-*`` checkpoint is returned instead.
    Completeness is checked by size, cheaply; load_state verifies every checksum.
    """
    root = Path(directory)
    if (root / META).is_file():
        return root
    if not root.is_dir():
        return None
    target = _pointer_target(root)
    if target is not None and complete(target) is not None:
        return target
    found = []
    for entry in os.scandir(root):
        if entry.name.startswith("step-") and entry.is_dir(follow_symlinks=False):
            meta = complete(Path(entry.path))
            if meta is not None:
                found.append((meta["step"], entry.name.endswith(RESAVED), Path(entry.path)))
    return max(found, key=lambda f: f[:2])[2] if found else None


def _point_at(root: Path, path: Path, step: int) -> None:
    write_json(root / LATEST, {"format": FORMAT, "checkpoint": path.name, "step": step})
    fsync_dir(root)


def _swap_in(root: Path, staged: Path, final: Path, step: int) -> None:
    """Replace ``final`` by the complete ``staged`` copy; a crash at any line leaves a complete copy
    of the step that latest.json names or latest_checkpoint's fallback finds."""
    old = root / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    _point_at(root, staged, step)  # the new copy is the one named while the old one moves
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)  # a crash right after: latest names a gone directory; the fallback finds final
    fsync_dir(root)
    _point_at(root, final, step)
    shutil.rmtree(old, ignore_errors=True)


def publish(root: Path, partial: Path, step: int) -> Path:
    """Make a fully written checkpoint visible: rename into place, then move the latest pointer.

    A re-save of an existing step never moves the old copy away before the new one is complete
    under its own name and named by latest.json (see :func:`_swap_in`)."""
    final = root / checkpoint_name(step)
    fsync_dir(partial)
    if not final.exists():
        os.replace(partial, final)
        try:
            fsync_dir(root)
            _point_at(root, final, step)
        except OSError:  # latest.json could not move (a full disk): not published, back to partial
            os.replace(final, partial)
            raise
        return final
    staged = root / f"{final.name}{RESAVED}"
    shutil.rmtree(staged, ignore_errors=True)
    os.replace(partial, staged)
    fsync_dir(root)
    _swap_in(root, staged, final, step)
    return final


def recover(root: Path) -> None:
    """Finish what a crashed re-save left (a ``.resaved`` copy not yet in place, an ``.old`` one)."""
    if not root.is_dir():
        return
    for staged in sorted(root.glob(f"step-*{RESAVED}")):
        final = root / staged.name.removesuffix(RESAVED)
        meta = complete(staged)
        if meta is None:
            shutil.rmtree(staged, ignore_errors=True)
        else:
            _swap_in(root, staged, final, meta["step"])
    for stale in (*root.glob(".step-*.old"), *root.glob(".step-*.partial")):  # saves run one at a time
        shutil.rmtree(stale, ignore_errors=True)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (never the one latest.json names)."""
    newest = latest_checkpoint(root)
    done = sorted(p for p in root.glob("step-*") if _STEP.fullmatch(p.name) and (p / META).is_file())
    for path in done[:-keep]:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)

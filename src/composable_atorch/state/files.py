"""The on-disk layout of checkpoints, and how one becomes visible atomically.

    ckpt/
      latest.json              {"checkpoint": "step-00000100", ...}: the newest complete one
      step-00000100/           DCP's files, rank-N.json per rank, checkpoint.json
      .step-00000104.partial/  a save in progress (or one a crash interrupted)

A save writes everything into the ``.partial`` directory and fsyncs it; :func:`publish` then
renames it into place and only after that moves ``latest.json`` (written to a temporary name,
fsynced, ``os.replace``-d). A crash at any point therefore leaves ``latest.json`` naming a
complete checkpoint. Everything here is JSON: nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from composable_atorch.errors import ConfigError

FORMAT = "composable_atorch.checkpoint"
VERSION = 1
LATEST = "latest.json"
META = "checkpoint.json"


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
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(what, str(path), f"a readable JSON file written by save_state ({exc})") from None


def check_jsonable(value: Any, where: str) -> Any:
    """``value`` itself if JSON can hold it; ConfigError naming ``where`` otherwise."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            where, type(value).__name__, f"JSON values (dicts with string keys, lists, numbers, strings): {exc}"
        ) from None
    return value


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory`` (what load_state would load), or None.

    ``directory`` may also be one ``step-*`` checkpoint itself.
    """
    root = Path(directory)
    if (root / META).is_file():
        return root
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = read_json(pointer, "latest checkpoint pointer").get("checkpoint")
    path = root / str(name)
    return path if (path / META).is_file() else None


def publish(root: Path, partial: Path, step: int) -> Path:
    """Make a fully written checkpoint visible: rename into place, then move the latest pointer."""
    final = root / checkpoint_name(step)
    fsync_dir(partial)
    old = root / f".{final.name}.old"
    if final.exists():  # the same step saved again: keep the old one until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(root)
    write_json(root / LATEST, {"format": FORMAT, "checkpoint": final.name, "step": step})
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (never the one latest.json names)."""
    newest = latest_checkpoint(root)
    done = sorted(p for p in root.glob("step-*") if (p / META).is_file())
    for path in done[:-keep]:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)

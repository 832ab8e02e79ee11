"""What an elastic restart cost, said once by the resumed rank 0 (the rank side of ``launch --nnodes``).

The launcher (``cli/elastic.py``) records, through torchelastic's metrics hook, when its agent
found the group failed or restarted it for a new node, and how long the rendezvous took; restarted
ranks inherit that as ``COMPOSABLE_ATORCH_RESTART`` (JSON). :func:`report_resumed` reads it and the
checkpoint the round resumed from, so a user sees the time from the failure to the first resumed
step and the training done again since the last save. It lives here, beside the checkpoints, so a
training script imports it from the package (``composable_atorch.report_resumed``), not from the CLI.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: what the launcher tells restarted ranks about the restart (JSON)
RESTART_ENV = "COMPOSABLE_ATORCH_RESTART"

# -- the rank side: what the restart cost --------------------------------------------------------
_reported = False


def restart_record() -> dict[str, Any] | None:
    """The launcher's record of the restart this process belongs to; None in a first round."""
    text = os.environ.get(RESTART_ENV)
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("at"), int | float) else None


def _checkpoint_info(checkpoint_dir) -> dict[str, Any]:
    from composable_atorch.state.files import META, latest_checkpoint

    path = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    if path is None or not (path / META).is_file():
        return {}
    meta = json.loads((path / META).read_text())
    return {"step": meta.get("step"), "world": meta.get("world_size"), "saved_at": (path / META).stat().st_mtime}


def _resumed_line(info: dict[str, Any]) -> str:
    world, saved_world = info["world"], info.get("saved_world")
    if saved_world is None or saved_world == world:
        why = {"failure": "after a failure", "start": "started again"}.get(info["cause"], "after a membership change")
    else:
        why = "a node lost" if world < saved_world else "a node joined"
    line = f"composable_atorch: resumed at world {world} ({why}"
    if saved_world is not None:
        line += f"; checkpoint of step {info['saved_step']} saved at world {saved_world}"
    since = "this node's launcher started" if info["cause"] == "start" else "this node's restart began"
    line += f"): step {info['step']} done {info['seconds']:.1f} s after {since}"
    if info["rendezvous_s"] is not None:
        line += f" (rendezvous {info['rendezvous_s']:.1f} s)"
    if "redone_s" in info:
        line += f"; the {info['redone_s']:.1f} s of training since that checkpoint were done again"
    return line


def report_resumed(step: int, checkpoint_dir=None, *, now: float | None = None) -> dict[str, Any] | None:
    """Call after each optimizer step, before saving: once per process, in a restarted round, say what it cost.

    Rank 0 prints one line, e.g. ``composable_atorch: resumed at world 3 (a node lost; checkpoint of
    step 2 saved at world 4): step 3 done 11.2 s after this node's restart began (rendezvous 3.3 s);
    the 2.0 s of training since that checkpoint were done again``. Every rank returns the figures
    as a dict (None when nothing was resumed, and after the first call: later calls cost nothing).
    Ranks of a node that joins a running job (or of a job started again) resumed too: they report
    the seconds since their launcher started, when ``checkpoint_dir`` holds a checkpoint.
    ``checkpoint_dir`` is the directory given to save_state; its latest checkpoint is the one
    resumed from as long as this round has not saved yet (hence: before saving).
    """
    global _reported
    if _reported:
        return None
    _reported = True
    record = restart_record()
    if record is None:
        return None
    now = time.time() if now is None else now
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = {
        "cause": record.get("cause"),
        "world": world,
        "step": step,
        "seconds": round(now - record["at"], 2),
        "rendezvous_s": record.get("rendezvous_s"),
    }
    saved = _checkpoint_info(checkpoint_dir)
    if saved and saved["step"] is not None and saved["step"] >= step:  # saved by this round already
        saved = {}
    if record.get("cause") == "start" and not saved:
        return None  # a fresh start: nothing was resumed
    if saved:
        info.update(saved_step=saved["step"], saved_world=saved["world"])
        if record.get("cause") != "start":  # a joining node's start says nothing about the others' work
            info["redone_s"] = round(max(0.0, record["at"] - saved["saved_at"]), 2)
    if os.environ.get("RANK", "0") == "0":
        print(_resumed_line(info), flush=True)
    return info

"""Run an example as a user would: ``python -m composable_atorch launch --nproc N examples/X.py``
(``test_examples.py``: the project's examples; ``test_atorch_examples.py``: ATorch's, ported in the
import prefix only). Two files so that the README's test command runs them on two workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def launch(
    script: str,
    *args: str,
    env: dict | None = None,
    timeout: float = 240,
    cwd: Path | None = None,
    nproc: int = 2,
) -> str:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("OMP_NUM_THREADS", None)  # the launcher sets 1 per rank
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nproc", str(nproc), str(EXAMPLES / script), *args]
    proc = subprocess.run(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def losses_of(out: str, pattern: str) -> list[float]:
    """The losses a script printed: ``pattern``'s group on every line it matches."""
    return [float(v) for v in re.findall(pattern, out, flags=re.MULTILINE)]

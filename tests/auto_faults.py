"""Workloads with injected faults for the auto-search tests (importable: trials run in fresh processes).

``FaultyGPT`` crashes under autocast (so every amp plan crashes) and, on micro-batches of
``hang_batch`` samples (an accumulation plan), starts a grandchild process and hangs — the
trial runner must kill both. Every pid it starts is appended to ``pid_file``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss


class FaultyGPT(GPT):
    def __init__(self, pid_file: str, hang_batch: int):
        super().__init__(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))
        self.pid_file, self.hang_batch = pid_file, hang_batch

    def _record(self, pid: int) -> None:
        with open(self.pid_file, "a") as f:
            f.write(f"{pid}\n")

    def forward(self, tokens):
        self._record(os.getpid())
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("injected crash under autocast")
        if tokens.size(0) == self.hang_batch:
            child = subprocess.Popen(["sleep", "600"])
            self._record(child.pid)
            time.sleep(600)
        return super().forward(tokens)


class FaultyModelFn:
    def __init__(self, pid_file: str, hang_batch: int):
        self.pid_file, self.hang_batch = pid_file, hang_batch

    def __call__(self):
        return FaultyGPT(self.pid_file, self.hang_batch)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def lm_step(model, batch):
    tokens, targets = batch
    return lm_loss(model(tokens), targets)


def alive(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


class HangingGPT(GPT):
    """A model whose forward never returns (the search's time budget must still hold)."""

    def __init__(self):
        super().__init__(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))

    def forward(self, tokens):
        while True:
            time.sleep(0.5)


class EscapingStep:
    """A loss that starts a process leaving the trial's session (``os.setsid()``) and sleeping; its
    command line carries ``token`` so a test can look for it in /proc."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, model, batch):
        code = f"import os, time; os.setsid(); time.sleep(600)  # {self.token}"
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return lm_step(model, batch)


def processes_with(token: str) -> list[int]:
    """Live pids whose command line holds ``token``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if token.encode() in f.read() and alive(int(entry.name)):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


class StubbornGPT(GPT):
    """A forward that hangs and swallows every ordinary exception (a retry loop): a time limit must
    still end it."""

    def __init__(self):
        super().__init__(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))

    def forward(self, tokens):
        while True:
            try:
                time.sleep(0.5)
            except Exception:  # noqa: BLE001, S112 - the point: a user's retry loop
                continue


class StartedWith:
    """A model factory that builds the small GPT only where this process *started* with (or, with
    ``present=False``, without) ``needle`` in its environment (``/proc/self/environ``, what glibc
    reads at start), and raises naming what it found otherwise."""

    def __init__(self, needle: str, present: bool = True):
        self.needle, self.present = needle, present

    def __call__(self):
        with open("/proc/self/environ", "rb") as f:
            start = [e.decode(errors="replace") for e in f.read().split(b"\0") if e.startswith(b"GLIBC_TUNABLES=")]
        if any(self.needle in e for e in start) != self.present:
            raise RuntimeError(f"started with {start or 'no GLIBC_TUNABLES'}")
        return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))


def _refuse_to_load():
    raise RuntimeError("this rank cannot load its workload")


class FailsToArrive:
    """A model factory the parent pickles and a rank cannot unpickle (loading it raises): the rank dies
    while it starts, before its log begins, as every rank does when the user's script starts the search
    outside an ``if __name__ == "__main__":`` block (the rank re-runs the script on import)."""

    def __call__(self):
        return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))

    def __reduce__(self):
        return (_refuse_to_load, ())

"""The elastic scenario of tests/cli/test_elastic_launch.py and benchmarks/elastic.py, and its reference.

:func:`run` starts four one-process "nodes" on localhost (four ``launch --nnodes 3:4`` processes
sharing one c10d rendezvous) running train_elastic.py, SIGKILLs node 3 (its launcher and its
worker) while the other ranks are inside step 4, waits until the job goes on at world 3 and
reaches step 7, starts a fourth node again, and waits until the job ends at world 4. It returns
every rank's step records and when the failure and the join happened. :func:`reference_run` is
the uninterrupted run: one process, plain PyTorch, the same global batches in the same order.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

HERE = Path(__file__).parent
SCRIPT = HERE / "train_elastic.py"
STEPS, SAVE_EVERY, VICTIM_PAUSE, GROW_PAUSE = 12, 2, 3, 7
#: each round is (the step it resumed from, its world size)
ROUNDS = [(0, 4), (2, 3), (6, 4)]


class ScenarioError(Exception):
    """A node failed or the job did not get where it should; the message holds the nodes' logs."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(
    tmp: Path,
    endpoint: str,
    node_rank: int,
    name: str,
    env: dict,
    victim: bool,
    waits,
    *,
    nodes: str = "3:4",
    nproc: int = 1,
    restarts: int = 3,
    train: tuple[str, ...] = (),
) -> subprocess.Popen:
    """A ``launch`` node; ``train`` are train_elastic.py's arguments (this scenario's by default)."""
    env = dict(env, ELASTIC_VICTIM="1") if victim else env
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nnodes", nodes, "--nproc", str(nproc)]
    cmd += ["--node-rank", str(node_rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic-test"]
    cmd += [
        "--max-restarts",
        str(restarts),
        "--last-call",
        str(waits[0]),
        "--node-timeout",
        str(waits[1]),
        "--join-timeout",
        "120",
    ]
    cmd += ["--timeout", "60", str(SCRIPT), "--ckpt", str(tmp / "ckpt"), "--out", str(tmp / "out")]
    cmd += train or ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    cmd += [] if train else ["--victim-pause", str(VICTIM_PAUSE), "--grow-pause", f"{GROW_PAUSE}:3"]
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.name = name
    return proc


def logs(tmp: Path, tail: int | None = None) -> str:
    """Every node's log, whole or its last ``tail`` characters (enough to show why a node failed).

    What rank 0 printed mid-run is only in the whole log: a node's log can end with kilobytes of
    torch's own warnings after it.
    """
    texts = {p.name: p.read_text() for p in sorted(tmp.glob("*.log"))}
    return "\n".join(f"==== {name}\n{text[-tail:] if tail else text}" for name, text in texts.items())


def _wait_until(condition, nodes, tmp: Path, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        failed = [n.name for n in nodes if n.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            why = f"nodes {failed} failed" if failed else "timed out"
            raise ScenarioError(f"waiting for {what}: {why}\n{logs(tmp, tail=3000)}")
        time.sleep(0.05)


def run(
    tmp: Path, *, env_changes: dict | None = None, seconds: float = 150, last_call: int = 2, node_timeout: int = 3
) -> dict:
    """The scenario in ``tmp``: ``{"records", "killed_at", "grown_at", "logs"}`` (whole); ScenarioError if it failed.

    The short rendezvous waits (``launch --last-call 2 --node-timeout 3``) keep the test fast; a
    lost node on localhost is noticed at once (its sockets close), so they are safe here.
    """
    waits = (last_call, node_timeout)
    out = tmp / "out"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_changes or {})
    endpoint = f"127.0.0.1:{_free_port()}"
    # the non-host nodes first, and node 0 (the rendezvous store) once they had time to start
    # Python: they then join together when the store comes up, well within the last call. A node
    # later than that would make a first round at world 3 (the job is elastic), not what is tested
    nodes = [_start_node(tmp, endpoint, r, f"node{r}", env, r == 3, waits) for r in (1, 2, 3)]
    time.sleep(3)
    nodes.append(_start_node(tmp, endpoint, 0, "node0", env, False, waits))
    victim = next(n for n in nodes if n.name == "node3")
    try:
        _wait_until(lambda: (out / "victim-0.pid").exists(), nodes, tmp, f"node 3 at step {VICTIM_PAUSE}", seconds)
        killed_at = time.time()
        victim.kill()
        os.kill(int((out / "victim-0.pid").read_text()), signal.SIGKILL)
        victim.wait()
        nodes.remove(victim)
        paused = lambda: len(list(out.glob("paused-*"))) == 3  # noqa: E731
        _wait_until(paused, nodes, tmp, f"world 3 at step {GROW_PAUSE}", seconds)
        grown_at = time.time()
        nodes.append(_start_node(tmp, endpoint, 3, "node3-again", env, False, waits))
        _wait_until(lambda: all(n.poll() is not None for n in nodes), nodes, tmp, "the end", seconds)
        if any(n.returncode for n in nodes):
            failed = [(n.name, n.returncode) for n in nodes if n.returncode]
            raise ScenarioError(f"at the end: nodes {failed} failed\n{logs(tmp, tail=3000)}")
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    records = [json.loads(line) for f in out.glob("steps-*.jsonl") for line in f.read_text().splitlines()]
    return {"records": records, "killed_at": killed_at, "grown_at": grown_at, "logs": logs(tmp)}


#: the node-loss scenario: hybrid sharding on 2 nodes of 2 processes, node 1 lost after step 6
NODE_LOSS_STEPS, NODE_LOSS_SAVE_EVERY, NODE_LOSS_PAUSE = 8, 4, 6


def run_node_loss(tmp: Path, *, seconds: float = 150) -> dict:
    """``launch --nnodes 2 --nproc 2 --max-restarts 1`` twice on localhost training under hybrid
    sharding; every process of node 1 (launcher and workers) is SIGKILLed after step 6, and a
    replacement node 1 is started: node 0 restarts its ranks (its one restart), the two nodes
    rendezvous again and resume from the step-4 checkpoint. ``{"records", "logs"}``."""
    out = tmp / "out"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    endpoint = f"127.0.0.1:{_free_port()}"
    train = ("--steps", str(NODE_LOSS_STEPS), "--save-every", str(NODE_LOSS_SAVE_EVERY), "--hybrid")
    victim_pause = ("--victim-pause", str(NODE_LOSS_PAUSE))
    shape = {"nodes": "2", "nproc": 2, "restarts": 1}
    start = functools.partial(_start_node, tmp, endpoint, env=env, waits=(2, 3), **shape)
    # the non-host node first (it waits for node 0's store); a fixed --nnodes 2 waits for both
    nodes = [start(1, "node1", victim=True, train=train + victim_pause)]
    nodes.append(start(0, "node0", victim=False, train=train + victim_pause))
    pids = [out / "victim-0.pid", out / "victim-1.pid"]
    try:
        _wait_until(lambda: all(p.exists() for p in pids), nodes, tmp, f"node 1 at step {NODE_LOSS_PAUSE}", seconds)
        victim = nodes.pop(0)
        victim.kill()  # the launcher, then its workers: every process of the node
        for pid in pids:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        victim.wait()
        nodes.append(start(1, "node1-replacement", victim=False, train=train))
        _wait_until(lambda: all(n.poll() is not None for n in nodes), nodes, tmp, "the end", seconds)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    records = [json.loads(line) for f in out.glob("steps-*.jsonl") for line in f.read_text().splitlines()]
    return {"records": records, "logs": logs(tmp)}


def rounds_of(records: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["start"], r["world"]) for r in records})


def history(records: list[dict], steps: int = STEPS) -> dict[int, list[dict]]:
    """For each step, the records of the last round that trained it: what the final weights saw.

    A later round resumes from a checkpoint and trains the steps after it again, so a step's
    last round is the one with the latest start before it.
    """
    rounds = rounds_of(records)
    return {
        step: [
            r
            for r in records
            if r["step"] == step and (r["start"], r["world"]) == max(k for k in rounds if k[0] < step)
        ]
        for step in range(1, steps + 1)
    }


def reference_run(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], list[list[int]]]:
    """Losses, final state and sorted sample ids per step of the uninterrupted run."""
    sys.path.insert(0, str(HERE))
    try:
        from train_elastic import BATCH, Numbered, make_optimizer, tiny_model
    finally:
        sys.path.remove(str(HERE))
    data, model = Numbered(), tiny_model()
    optim = make_optimizer(model)
    losses, batches, epoch = [], [], 0
    while len(losses) < steps:
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)  # its permutation at any world
        order.set_epoch(epoch)
        order = list(order)
        for start in range(0, len(order), BATCH):
            ids = order[start : start + BATCH]
            loss = torch.nn.functional.mse_loss(model(data.x[ids]), data.y[ids])
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            batches.append(sorted(ids))
            if len(losses) == steps:
                break
        epoch += 1
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, batches

"""``launch --nnodes MIN:MAX``: a job that loses a node goes on smaller, grows back, and trains as if nothing happened.

Four one-process "nodes" on localhost (four launchers sharing one c10d rendezvous) train a tiny
model with ``fsdp()`` (tests/scripts/train_elastic.py). Node 3 is SIGKILLed (launcher and worker)
in the middle of step 4; the three others restart, rendezvous at world 3, resume from the last
checkpoint (step 2) and train on; at step 7 a fourth node joins again, the job restarts at world 4
from step 6 and finishes. The record of every rank's sample ids and losses must show the run an
uninterrupted one would have been: every sample once per epoch, each step's loss and the final
weights equal to a plain single-process run on the same global batches.
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
from torch.utils.data.distributed import DistributedSampler

from composable_atorch.cli import elastic, launch

from _dist import free_port

SCRIPTS = Path(__file__).parent.parent / "scripts"
SCRIPT = SCRIPTS / "train_elastic.py"
STEPS, SAVE_EVERY, VICTIM_PAUSE, GROW_PAUSE = 12, 2, 3, 7


@pytest.mark.parametrize(
    "nnodes, message",
    [("3:2", "MIN 3 is above MAX 2"), ("0:4", "must be >= 1"), ("2:x", "not N or MIN:MAX"), ("1:2:3", "MIN:MAX")],
)
def test_bad_node_ranges_exit_2(capsys, nnodes, message):
    argv = ["--nnodes", nnodes, "--nproc", "1", "--rdzv-endpoint", "127.0.0.1:29400", str(SCRIPT)]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


def test_elastic_command_line_and_environment(monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    ns = launch.parser().parse_args(
        ["--nnodes", "2:4", "--node-rank", "3", "--nproc", "1", "--rdzv-endpoint", "h:1", "--last-call", "2", "t.py"]
    )
    args = launch.torchrun_args(ns)
    assert args[args.index("--nnodes") + 1] == "2:4"
    conf = dict(kv.split("=") for kv in args[args.index("--rdzv-conf") + 1].split(","))
    assert conf == {
        "is_host": "0",
        "join_timeout": "600",
        "last_call_timeout": "2",
        "keep_alive_interval": "5",
        "keep_alive_max_attempt": "3",
    }
    ns.node_timeout = 4  # a short one beats every second
    assert "keep_alive_interval=1,keep_alive_max_attempt=4" in elastic.rdzv_conf(ns)
    # a membership change restarts ranks even without --max-restarts: they need a store per round
    assert launch.rank_environment(ns)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert launch.main(["--nnodes", "2:4", "--node-rank", "4", "--nproc", "1", "--rdzv-endpoint", "h:1", "x"]) == 2


def test_the_restart_record_and_the_resumed_line(monkeypatch, capsys, tmp_path):
    from types import SimpleNamespace as Metric

    monkeypatch.delenv(elastic.RESTART_ENV, raising=False)
    recorder = elastic.RestartRecorder()
    for name, when, value in [
        ("LocalElasticAgent._monitor_workers.duration.ms", 99.0, 1),
        ("workers.default.failed", 100.0, 1),
        ("LocalElasticAgent._stop_workers.duration.ms", 100.5, 400),
        ("SimpleElasticAgent._rendezvous.duration.ms", 104.0, 3500),
    ]:
        recorder.emit(Metric(name=name, timestamp=when, value=value))
    record = json.loads(os.environ[elastic.RESTART_ENV])
    assert record == {"cause": "failure", "at": 100.0, "stopped_s": 0.4, "rendezvous_s": 3.5}
    recorder.emit(Metric(name="LocalElasticAgent._stop_workers.duration.ms", timestamp=200.0, value=500))
    assert json.loads(os.environ[elastic.RESTART_ENV])["cause"] == "membership"
    assert json.loads(os.environ[elastic.RESTART_ENV])["at"] == 199.5

    monkeypatch.setattr(elastic, "_reported", False)
    monkeypatch.setenv(elastic.RESTART_ENV, json.dumps(record))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    info = elastic.report_resumed(5, now=107.25)
    assert info == {"cause": "failure", "world": 3, "step": 5, "seconds": 7.25, "rendezvous_s": 3.5}
    line = capsys.readouterr().out
    assert "resumed at world 3 (after a failure): step 5 done 7.2 s after this node's restart began" in line
    assert "(rendezvous 3.5 s)" in line
    assert elastic.report_resumed(6) is None  # once per process
    monkeypatch.setattr(elastic, "_reported", False)
    monkeypatch.delenv(elastic.RESTART_ENV)
    assert elastic.report_resumed(1) is None  # a first round: nothing to report


# -- the run ---------------------------------------------------------------------------------------
def start_node(tmp: Path, endpoint: str, node_rank: int, name: str, *, victim: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if victim:
        env["ELASTIC_VICTIM"] = "1"
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nnodes", "3:4", "--nproc", "1"]
    cmd += ["--node-rank", str(node_rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic-test"]
    cmd += ["--max-restarts", "3", "--last-call", "1", "--node-timeout", "3", "--join-timeout", "120"]
    cmd += ["--timeout", "60", str(SCRIPT), "--ckpt", str(tmp / "ckpt"), "--out", str(tmp / "out")]
    cmd += ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    cmd += ["--victim-pause", str(VICTIM_PAUSE), "--grow-pause", f"{GROW_PAUSE}:3"]
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.name = name
    return proc


def logs(tmp: Path) -> str:
    return "\n".join(f"==== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


def wait_until(condition, nodes, tmp: Path, what: str, seconds: float = 150) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        failed = [n.name for n in nodes if n.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}: {'nodes ' + str(failed) + ' failed' if failed else 'timed out'}\n"
                        f"{logs(tmp)}")  # fmt: skip
        time.sleep(0.05)


def reference_run() -> tuple[list[float], dict[str, torch.Tensor], list[list[int]]]:
    """The uninterrupted run: one process, plain PyTorch, the same global batches in the same order."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from train_elastic import BATCH, Numbered, make_optimizer, tiny_model
    finally:
        sys.path.remove(str(SCRIPTS))
    data, model = Numbered(), tiny_model()
    optim = make_optimizer(model)
    losses, batches, epoch = [], [], 0
    while len(losses) < STEPS:
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)  # its permutation at any world
        order.set_epoch(epoch)
        order = list(order)
        for start in range(0, len(order), BATCH):
            ids = order[start : start + BATCH]
            x, y = data.x[ids], data.y[ids]
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            batches.append(sorted(ids))
            if len(losses) == STEPS:
                break
        epoch += 1
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, batches


@pytest.mark.dist
@pytest.mark.slow
def test_lose_a_node_go_on_at_3_grow_back_to_4_as_if_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "out").mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_node(tmp_path, endpoint, r, f"node{r}", victim=r == 3) for r in (1, 2, 3, 0)]
    victim = next(n for n in nodes if n.name == "node3")
    out = tmp_path / "out"
    try:
        wait_until(lambda: (out / "victim.pid").exists(), nodes, tmp_path, f"the victim to reach step {VICTIM_PAUSE}")
        killed_at = time.time()
        victim.kill()
        os.kill(int((out / "victim.pid").read_text()), signal.SIGKILL)
        victim.wait()
        nodes.remove(victim)
        paused = lambda: len(list(out.glob("paused-*"))) == 3  # noqa: E731
        wait_until(paused, nodes, tmp_path, f"world 3 to reach step {GROW_PAUSE}")
        grown_at = time.time()
        nodes.append(start_node(tmp_path, endpoint, 3, "node3-again"))
        for node in nodes:
            node.wait(timeout=150)
        assert [n.returncode for n in nodes] == [0] * 4, logs(tmp_path)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()

    records = [json.loads(line) for f in out.glob("steps-*.jsonl") for line in f.read_text().splitlines()]
    rounds = sorted({(r["start"], r["world"]) for r in records})
    assert rounds == [(0, 4), (2, 3), (6, 4)], rounds  # resumed from the last checkpoint each time
    # what the final weights saw: for each step, the last round that trained it (later rounds
    # redo the steps after their checkpoint); every rank of that round, once
    history = {}
    for step in range(1, STEPS + 1):
        start, world = max(r for r in rounds if r[0] < step)
        got = [r for r in records if r["step"] == step and (r["start"], r["world"]) == (start, world)]
        assert sorted(r["rank"] for r in got) == list(range(world)), (step, got)
        history[step] = got

    want_losses, want_state, want_batches = reference_run()
    for step, got in history.items():
        ids = sorted(i for r in got for i in r["ids"])
        assert ids == want_batches[step - 1], step  # the same global batch as the uninterrupted run
        loss = sum(r["loss"] for r in got) / len(got)  # equal shares: the mean of the ranks' means
        assert loss == pytest.approx(want_losses[step - 1], rel=1e-5, abs=1e-6), step
    per_epoch = {}
    for got in history.values():
        per_epoch.setdefault(got[0]["epoch"], []).extend(i for r in got for i in r["ids"])
    assert all(sorted(ids) == list(range(48)) for ids in per_epoch.values()), per_epoch  # once each, none skipped
    # a step trained, lost with its round and trained again saw the same global batch and loss
    redone = {}
    for r in records:
        if r not in history[r["step"]]:
            redone.setdefault((r["start"], r["world"], r["step"]), []).append(r)
    assert sorted(k[2] for k in redone) == [3, 7], sorted(redone)  # one step since each last save
    for (_, world, step), got in redone.items():
        assert len(got) == world and sorted(i for r in got for i in r["ids"]) == want_batches[step - 1]
        assert sum(r["loss"] for r in got) / world == pytest.approx(want_losses[step - 1], rel=1e-5, abs=1e-6)
    final = load_file(out / "final.safetensors")
    assert final.keys() == want_state.keys()
    for key in final:
        torch.testing.assert_close(final[key], want_state[key], rtol=1e-5, atol=1e-6)

    resumed = {(r["start"], r["world"]): r["resumed"] for r in records if "resumed" in r and r["rank"] == 0}
    assert resumed[(6, 4)]["cause"] == "membership"  # rank 0's node restarted for the new node
    assert resumed[(2, 3)]["saved_step"] == 2 and resumed[(2, 3)]["saved_world"] == 4
    first = {k: min(r["time"] for r in records if (r["start"], r["world"]) == k) for k in rounds}
    print(
        f"\nelastic 4 -> 3 -> 4: failure to first resumed step {first[(2, 3)] - killed_at:.1f} s "
        f"(agent's view {resumed[(2, 3)]['seconds']:.1f} s, rendezvous {resumed[(2, 3)]['rendezvous_s']:.1f} s); "
        f"node joined to first step at 4 {first[(6, 4)] - grown_at:.1f} s; "
        f"{VICTIM_PAUSE - 2} and {GROW_PAUSE - 6} step(s) redone (saving every {SAVE_EVERY})"
    )
    assert "resumed at world 3 (a node lost; checkpoint of step 2 saved at world 4): step 3 done" in logs(tmp_path)
    assert "resumed at world 4 (a node joined; checkpoint of step 6 saved at world 3): step 7 done" in logs(tmp_path)

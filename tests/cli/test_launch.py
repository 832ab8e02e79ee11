"""``python -m composable_atorch launch``: argument checks, one node, two "nodes" on localhost."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composable_atorch.cli import launch

from _dist import free_port

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = pytest.mark.serial

SCRIPT = Path(__file__).parent.parent / "scripts" / "report_ranks.py"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required"),
        (["--nproc", "0", str(SCRIPT)], "must be >= 1"),
        (["--nproc", "two", str(SCRIPT)], "not an integer"),
        (["--nproc", "2", "missing_script.py"], "not found"),
        (["--nproc", "1", "--nnodes", "2", str(SCRIPT)], "needs --rdzv-endpoint"),
        (
            ["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400", str(SCRIPT)],
            "below --nnodes 2",
        ),
        (["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", "localhost", str(SCRIPT)], "HOST:PORT"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


def test_torchrun_command_lines():
    ns = launch.parser().parse_args(["--nproc", "4", "train.py", "--lr", "3"])
    assert launch.torchrun_args(ns) == [
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "0",
        "train.py",
        "--lr",
        "3",
    ]
    ns = launch.parser().parse_args(
        ["--nnodes", "2", "--node-rank", "1", "--nproc", "8", "--rdzv-endpoint", "10.0.0.1:29400", "t.py"]
    )
    args = launch.torchrun_args(ns)
    assert args[: args.index("--rdzv-conf")] == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
        "--rdzv-id", "composable_atorch",
    ]  # fmt: skip
    assert args[args.index("--rdzv-conf") + 1].startswith("is_host=0,")  # node 0 hosts the store


def run_launch(*args, env_changes, out: Path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_changes)
    cmd = [sys.executable, "-m", "composable_atorch", "launch", *args, str(SCRIPT), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def reports(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


@pytest.mark.dist
def test_one_node_two_processes(tmp_path):
    proc = run_launch("--nproc", "2", env_changes={}, out=tmp_path)
    log = proc.communicate(timeout=180)[0].decode()
    assert proc.returncode == 0, log
    got = reports(tmp_path)
    assert [(r["rank"], r["local_rank"], r["world"]) for r in got] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["sum"] == 3.0 and r["omp_num_threads"] == "1" for r in got)  # all-reduce of 1 + 2


@pytest.mark.dist
def test_two_nodes_on_localhost_through_c10d_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        run_launch(
            "--nnodes",
            "2",
            "--node-rank",
            str(r),
            "--nproc",
            "1",
            "--rdzv-endpoint",
            endpoint,
            env_changes={"OMP_NUM_THREADS": "3"},
            out=tmp_path,
        )
        for r in (1, 0)  # the non-host node first: it waits for node 0's store
    ]
    logs = [p.communicate(timeout=180)[0].decode() for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs
    got = reports(tmp_path)
    assert [(r["rank"], r["local_rank"], r["world"]) for r in got] == [(0, 0, 2), (1, 0, 2)]
    assert all(r["sum"] == 3.0 and r["omp_num_threads"] == "3" for r in got)  # the user's setting wins


@pytest.mark.dist
def test_a_failing_rank_fails_the_launch_with_its_exit_code(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [
        sys.executable,
        "-m",
        "composable_atorch",
        "launch",
        "--nproc",
        "1",
        str(SCRIPT),
        str(tmp_path),
        "--exit-code",
        "3",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "report_ranks.py FAILED" in result.stderr


# -- lost and hung ranks -------------------------------------------------------------------------
RESTART = Path(__file__).parent.parent / "scripts" / "train_restart.py"


def test_every_rank_gets_a_store_per_round_the_timeout_and_the_heartbeat(monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.delenv("COMPOSABLE_ATORCH_TIMEOUT", raising=False)
    monkeypatch.delenv("COMPOSABLE_ATORCH_HEARTBEAT", raising=False)
    ns = launch.parser().parse_args(
        ["--nproc", "2", "--max-restarts", "1", "--timeout", "12.5", "--heartbeat", "4", "t.py"]
    )
    env = launch.rank_environment(ns)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["COMPOSABLE_ATORCH_TIMEOUT"] == "12.5"
    assert env["COMPOSABLE_ATORCH_HEARTBEAT"] == "4.0"
    defaults = launch.rank_environment(launch.parser().parse_args(["--nproc", "2", "t.py"]))
    assert defaults["COMPOSABLE_ATORCH_TIMEOUT"] == "300.0" and defaults["COMPOSABLE_ATORCH_HEARTBEAT"] == "45.0"
    assert launch.main(["--nproc", "1", "--timeout", "0", str(SCRIPT)]) == 2
    assert launch.main(["--nproc", "1", "--heartbeat", "-1", str(SCRIPT)]) == 2


def test_the_heartbeat_wait_is_at_most_half_the_collective_timeout(monkeypatch):
    from composable_atorch.errors import ConfigError
    from composable_atorch.runtime import liveness

    monkeypatch.delenv("COMPOSABLE_ATORCH_TIMEOUT", raising=False)
    monkeypatch.delenv("COMPOSABLE_ATORCH_HEARTBEAT", raising=False)
    assert liveness.heartbeat_wait() == liveness.DEFAULT_HEARTBEAT_S == 45.0  # a stopped rank: about a minute
    assert liveness.heartbeat_wait(timeout_s=30) == 15.0  # named before a collective fails naming nobody
    monkeypatch.setenv("COMPOSABLE_ATORCH_HEARTBEAT", "7")
    assert liveness.heartbeat_wait() == 7.0
    monkeypatch.setenv("COMPOSABLE_ATORCH_HEARTBEAT", "soon")
    with pytest.raises(ConfigError, match="COMPOSABLE_ATORCH_HEARTBEAT"):
        liveness.heartbeat_wait()


def launch_restart(tmp: Path, *args: str, launch_args=("--max-restarts", "1")) -> subprocess.CompletedProcess:
    for attempt in range(2):
        run_dir = tmp / f"attempt{attempt}"
        (run_dir / "out").mkdir(parents=True)
        cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nproc", "2", *launch_args, str(RESTART)]
        cmd += ["--ckpt", str(run_dir / "ckpt"), "--out", str(run_dir / "out"), "--steps", "10", "--save-every", "4"]
        result = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
        result.dir = run_dir
        # torch's own race, not what is tested: with a store per round, rank 0 binds a port the agent
        # picked and released, which another process on a busy machine may have taken meanwhile
        if "EADDRINUSE" not in result.stderr:
            break
    return result


@pytest.mark.dist
def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_bitwise_equal(tmp_path):
    from safetensors.torch import load_file

    reference = launch_restart(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = launch_restart(tmp_path / "killed", "--kill", "1:6")  # checkpoint at 4, killed after step 6
    assert killed.returncode == 0, killed.stderr[-3000:]
    log = killed.stdout + killed.stderr
    assert "exitcode: -9" in log and "resumed from step-00000004" in log
    rounds = [json.loads(line)["round"] for line in (killed.dir / "out" / "losses-rank0.jsonl").open()]
    assert rounds == ["0"] * 6 + ["1"] * 6  # steps 5 and 6 ran again in the restarted round
    want, got = (load_file(r.dir / "out" / "final.safetensors") for r in (reference, killed))
    assert want.keys() == got.keys() and len(want) > 20  # weights and AdamW state
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.mark.dist
def test_a_stopped_rank_ends_the_job_naming_the_rank_and_its_host(tmp_path, monkeypatch):
    # rank 1 SIGSTOPs itself after step 3; the collective timeout stays at launch's default 300 s: the
    # heartbeat ends it. The default heartbeat (45 s) reaches the ranks the same way as --heartbeat
    # (rank_environment; both checked above without the 45 s wait).
    monkeypatch.delenv("COMPOSABLE_ATORCH_TIMEOUT", raising=False)
    monkeypatch.delenv("COMPOSABLE_ATORCH_HEARTBEAT", raising=False)
    result = launch_restart(tmp_path, "--stop", "1:3", launch_args=("--heartbeat", "4"))
    assert result.returncode not in (0, None), result.stderr[-3000:]
    assert f"rank 1 stopped responding (rank 1: host {socket.gethostname()}, pid " in result.stderr, result.stderr[
        -3000:
    ]
    assert "no heartbeat for 4 s" in result.stderr
    # torchrun's SIGTERM reached the stopped rank at once (launch follows it with SIGCONT), where it
    # used to wait 30 s for the SIGKILL
    assert "Signal 15 (SIGTERM) received by PID" in result.stderr and "SIGKILL" not in result.stderr


def test_ranks_on_a_machine_without_cuda_get_mallocs_training_tunables_the_users_own_win(monkeypatch):
    from composable_atorch.environment import CPU_MALLOC_TUNABLES, MALLOC_ENV

    ns = launch.parser().parse_args(["--nproc", "2", "t.py"])
    for name in ("GLIBC_TUNABLES", MALLOC_ENV, "LD_PRELOAD", "MALLOC_ARENA_MAX"):
        monkeypatch.delenv(name, raising=False)
    assert launch.rank_environment(ns)["GLIBC_TUNABLES"] == ":".join(CPU_MALLOC_TUNABLES)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # another tunable of the user's is kept
    assert launch.rank_environment(ns)["GLIBC_TUNABLES"] == ":".join(("glibc.pthread.rseq=0", *CPU_MALLOC_TUNABLES))
    for name, value in (
        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
        ("MALLOC_ARENA_MAX", "2"),
        ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2"),
        (MALLOC_ENV, "default"),
    ):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert "GLIBC_TUNABLES" not in launch.rank_environment(ns), name
    with monkeypatch.context() as m:  # a CUDA machine keeps glibc's defaults (the tuning was measured on CPUs)
        import torch

        m.setattr(torch.cuda, "is_available", lambda: True)
        assert "GLIBC_TUNABLES" not in launch.rank_environment(ns)

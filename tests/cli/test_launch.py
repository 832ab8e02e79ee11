"""``python -m composable_atorch launch``: argument checks, one node, two "nodes" on localhost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composable_atorch.cli import launch

from _dist import free_port

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
    assert args[: args.index("--nproc-per-node")] == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
        "--rdzv-id", "composable_atorch", "--rdzv-conf", "is_host=0",
    ]  # fmt: skip


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

"""``python -m composable_atorch launch``: run a training script on N processes, over torchrun.

A thin layer over ``torch.distributed.run`` (torchrun): it checks the arguments up front, picks
the rendezvous, gives every rank ``OMP_NUM_THREADS=1`` unless you set it (and, on a machine
without CUDA, glibc's malloc tuned for training: ``environment.CPU_MALLOC_TUNABLES``), and returns
the exit status. The script reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and calls
``torch.distributed.init_process_group()`` as with torchrun itself.

One machine::

    python -m composable_atorch launch --nproc 4 train.py --steps 100

runs torchrun's ``--standalone`` rendezvous (a private store on a free port; a fixed
``--master-port 0`` without it hangs).

Several machines, through torchrun's c10d rendezvous: run the same command on every node with
its own ``--node-rank``; ``--rdzv-endpoint`` is the address of node 0, which hosts the
rendezvous store there (pick a port free on node 0)::

    # on node 0 (10.0.0.1)                     # on node 1
    python -m composable_atorch launch \\        python -m composable_atorch launch \\
      --nnodes 2 --node-rank 0 --nproc 8 \\        --nnodes 2 --node-rank 1 --nproc 8 \\
      --rdzv-endpoint 10.0.0.1:29400 \\            --rdzv-endpoint 10.0.0.1:29400 \\
      train.py                                    train.py

Global ranks are assigned by the rendezvous (node by node). ``--max-restarts K`` restarts the
whole group after a failure, up to K times: a script that resumes with
``composable_atorch.load_state`` from its last checkpoint then continues where it stopped.

Elastic: ``--nnodes MIN:MAX`` runs with any number of nodes from MIN to MAX. A lost node makes the
others restart without it (one of ``--max-restarts``); a node started later with the same
``--rdzv-endpoint``/``--rdzv-id`` makes them restart with it (free). Each restart runs the script
again at the new ``WORLD_SIZE``: it applies its plan there and ``load_state`` reshards the last
checkpoint. ``--last-call``, ``--node-timeout`` and ``--join-timeout`` bound the waits (see
cli/elastic.py, which also records what each restart cost for ``report_resumed``). Node 0 hosts
the rendezvous store: it must stay up (losing it ends the job).

With restarts or MIN < MAX, every round gets a fresh rendezvous store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): with torchrun's default, one store shared across
rounds, a restart after a killed rank failed about half the time here (gloo "connectFullMesh ...
Connection refused", or a hang before the first resumed step); with a store per round it passed
every time (see benchmarks/restarts.py and, for membership changes, benchmarks/elastic.py).

``--heartbeat SECONDS`` (default 45): a rank whose heartbeat stops that long (SIGSTOP, a frozen or
lost machine) is named, with its host, by a peer that then exits, so the job ends about a minute
after a rank stops instead of hanging for gloo's 30 minutes (see runtime/liveness.py for the cost).
``--timeout SECONDS`` (default 300) bounds each collective (a rank alive but stuck in a loop). The
script's ``init_distributed()`` or ``parallel_mode`` reads both (``COMPOSABLE_ATORCH_HEARTBEAT``,
``COMPOSABLE_ATORCH_TIMEOUT``).
"""

from __future__ import annotations

import argparse
import os
import sys

from composable_atorch.cli import elastic
from composable_atorch.environment import cpu_malloc_environment
from composable_atorch.runtime.liveness import DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S, HEARTBEAT_ENV, TIMEOUT_ENV

PROG = "python -m composable_atorch launch"


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as a return code (2) rather than by exiting."""

    def error(self, message):
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, with a message naming the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 10.0.0.1:29400)")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be > 0")
    return value


def rank_environment(ns: argparse.Namespace) -> dict[str, str]:
    """What every rank (and torchrun itself) gets in its environment; the user's own settings win."""
    # two ranks with several threads each on a small machine ran 5-10x slower (CPU_FACTS); torchrun
    # itself only sets this with more than one process per node
    env = {"OMP_NUM_THREADS": "1"}
    if elastic.is_elastic(ns):
        # a store per round (restarts and membership changes): the shared one broke about half the
        # restarts (module docstring). Only then: rank 0 binds a port the agent picked and closed,
        # which another process can take meanwhile (seen once in ~30 runs on a busy machine: EADDRINUSE)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if ns.timeout is not None:
        env[TIMEOUT_ENV] = repr(ns.timeout)
    else:
        env[TIMEOUT_ENV] = os.environ.get(TIMEOUT_ENV) or repr(DEFAULT_TIMEOUT_S)
    if ns.heartbeat is not None:
        env[HEARTBEAT_ENV] = repr(ns.heartbeat)
    else:
        env[HEARTBEAT_ENV] = os.environ.get(HEARTBEAT_ENV) or repr(DEFAULT_HEARTBEAT_S)
    env = {k: v for k, v in env.items() if k in (TIMEOUT_ENV, HEARTBEAT_ENV) or k not in os.environ}
    env.update(cpu_malloc_environment())  # ranks training on the CPU: glibc's malloc tuned for it
    return env


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run a training script on N processes (a thin layer over torchrun).")
    p.add_argument("--nproc", type=_positive, required=True, help="processes on this node (e.g. one per GPU)")
    p.add_argument(
        "--nnodes",
        type=elastic.nnodes,
        default=(1, 1),
        help="number of nodes, or MIN:MAX for an elastic job that goes on with MIN to MAX nodes (default 1)",
    )
    p.add_argument(
        "--node-rank",
        type=_non_negative,
        default=0,
        help="this node's index, 0..MAX-1 (node 0 hosts the rendezvous and must stay up)",
    )
    p.add_argument(
        "--rdzv-endpoint", type=_endpoint, default=None, help="HOST:PORT of node 0, required with several nodes"
    )
    p.add_argument("--rdzv-id", default="composable_atorch", help="job id shared by all nodes of one run")
    p.add_argument(
        "--max-restarts", type=_non_negative, default=0, help="restart the group after a failure up to this many times"
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="seconds a collective may wait before it fails (default 300)",
    )
    p.add_argument(
        "--heartbeat",
        type=_seconds,
        default=None,
        help=(
            f"seconds without a rank's heartbeat before the job ends naming it and its host (default "
            f"{DEFAULT_HEARTBEAT_S:g}; at most half of --timeout)"
        ),
    )
    elastic.add_arguments(p)
    p.add_argument("script", help="the training script (a .py file)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def torchrun_args(ns: argparse.Namespace) -> list[str]:
    """The torchrun command line (without the program name) for parsed launch arguments."""
    common = ["--nproc-per-node", str(ns.nproc), "--max-restarts", str(ns.max_restarts)]
    low, high = ns.nnodes
    if high == 1 and ns.rdzv_endpoint is None:
        return ["--standalone", *common, ns.script, *ns.args]
    return [
        "--nnodes", str(low) if low == high else f"{low}:{high}",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", ns.rdzv_endpoint,
        "--rdzv-id", ns.rdzv_id,
        "--rdzv-conf", elastic.rdzv_conf(ns),
        *common, ns.script, *ns.args,
    ]  # fmt: skip


def _check(ns: argparse.Namespace) -> None:
    low, high = ns.nnodes
    shown = str(low) if low == high else f"{low}:{high}"
    if high > 1 and ns.rdzv_endpoint is None:
        raise _UsageError(f"--nnodes {shown} needs --rdzv-endpoint HOST:PORT (the address of node 0)")
    if ns.node_rank >= high:
        raise _UsageError(f"--node-rank {ns.node_rank} must be below --nnodes {shown} (at most {high} nodes)")
    if not os.path.isfile(ns.script):
        raise _UsageError(f"script {ns.script!r} not found")


def continue_stopped_ranks() -> None:
    """Make torchrun's closing signal reach a rank that is stopped (SIGSTOP, a frozen debugger).

    When a peer names a stopped rank and exits, torchrun's agent sends every rank SIGTERM, waits 30 s,
    then SIGKILL. A stopped process takes no signal but SIGKILL and SIGCONT, so the SIGTERM waited
    there for the whole 30 s (measured: the job ended 30 s after the heartbeat named the rank).
    Following the closing signal with SIGCONT lets the rank take it at once. Only this process's own
    agent is changed (``launch`` runs torchrun in-process), and only on POSIX.
    """
    import signal

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as handler

    cls = handler.SubprocessHandler
    if os.name != "posix" or getattr(cls.close, "_continues_stopped", False):
        return
    original = cls.close

    def close(self, death_sig=None):
        original(self, death_sig)
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):  # gone already
            pass

    close._continues_stopped = True
    cls.close = close


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    try:
        ns = p.parse_args(argv)
        _check(ns)
    except _UsageError as exc:
        print(f"{p.format_usage()}{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    os.environ.update(rank_environment(ns))
    if elastic.is_elastic(ns):
        elastic.install_recorder()

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    continue_stopped_ranks()
    if ns.rdzv_endpoint is not None:  # several nodes: node 0 hosts the rendezvous store
        elastic.host_leaves_last(is_host=ns.node_rank == 0)

    try:
        torchrun.run(torchrun.parse_args(torchrun_args(ns)))
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        codes = [f.exitcode for f in exc.failures.values()]
        return next((c for c in codes if c > 0), 1)
    return 0

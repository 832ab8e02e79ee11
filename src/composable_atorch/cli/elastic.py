"""Elastic launch: ``--nnodes MIN:MAX``, rendezvous timeouts, and how long a restart cost.

torchrun's elastic agent does the membership work: every node's agent joins a c10d rendezvous;
the round starts with MAX nodes at once, or with MIN or more once ``--last-call`` seconds passed
without another node arriving. Then:

* a node lost (killed, crashed, its machine gone): the other ranks' collectives fail, their
  agents restart the group (spending one of ``--max-restarts``) and rendezvous again without it.
  The lost node's entry leaves the rendezvous when its agent's heartbeat is ``--node-timeout``
  seconds old, and the smaller round starts ``--last-call`` seconds after that: a shrink costs
  about their sum plus the workers' start and checkpoint load. torchrun's defaults (15 s and
  30 s) make every shrink wait 45 s; here they are 15 s and 10 s, and settable.
* a node gained (a new launcher with the same ``--rdzv-endpoint``/``--rdzv-id``): it waits in
  the rendezvous; the running agents notice within 0.1 s and restart their workers into a bigger
  round. That costs no restart from ``--max-restarts`` (a rank that fails in a collective while
  its peers are being stopped does spend one, so keep a few).

Each restarted rank starts the user's script again: it loads the latest checkpoint with
``composable_atorch.load_state`` (resharded for the new world) and applies its plan at the new
``WORLD_SIZE``. Everything done since that checkpoint is done again: save often enough that this
costs less than the restart itself.

The launcher records, through torchelastic's metrics hook (a documented extension point), when
its agent found the group failed or decided to restart it for a new node, and how long the
rendezvous took. Restarted ranks inherit that as ``COMPOSABLE_ATORCH_RESTART`` (JSON), and
:func:`report_resumed`, called by the script after each step, prints once on rank 0 how many
seconds the restart cost up to the first resumed step and how much training since the last
checkpoint was done again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

# the rank side (report_resumed) lives with the checkpoints it reads: state/restarts.py
from composable_atorch.state.restarts import RESTART_ENV

#: torchrun's own defaults are 600 s / 30 s / 15 s (5 s heartbeats, 3 missed)
DEFAULT_JOIN_TIMEOUT_S = 600
DEFAULT_LAST_CALL_S = 10
DEFAULT_NODE_TIMEOUT_S = 15


def nnodes(text: str) -> tuple[int, int]:
    """An argparse type: ``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX (e.g. 2:4)")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the minimum number of nodes must be >= 1")
    if low > high:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN {low} is above MAX {high}")
    return low, high


def whole_seconds(text: str) -> int:
    """An argparse type: whole seconds >= 1 (torch's rendezvous reads its timeouts as integers)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--join-timeout",
        type=whole_seconds,
        default=DEFAULT_JOIN_TIMEOUT_S,
        help=f"seconds a node waits for MIN nodes before giving up (default {DEFAULT_JOIN_TIMEOUT_S})",
    )
    p.add_argument(
        "--last-call",
        type=whole_seconds,
        default=DEFAULT_LAST_CALL_S,
        help="with MIN to MAX nodes: seconds to wait for more nodes once MIN are there, at start and after "
        f"a node was lost (default {DEFAULT_LAST_CALL_S}; torchrun's is 30)",
    )
    p.add_argument(
        "--node-timeout",
        type=whole_seconds,
        default=DEFAULT_NODE_TIMEOUT_S,
        help="seconds without a heartbeat after which a node's agent counts as lost and leaves the "
        f"rendezvous (default {DEFAULT_NODE_TIMEOUT_S})",
    )


def rdzv_conf(ns: argparse.Namespace) -> str:
    """torchrun's ``--rdzv-conf`` for the c10d rendezvous: who hosts the store, and the timeouts."""
    # heartbeats every second under a short timeout (a few missed beats make a lost node), every
    # 5 s (torchrun's interval) otherwise; the rendezvous reads both as integers
    interval = 1 if ns.node_timeout < 3 * 5 else 5
    attempts = max(1, math.ceil(ns.node_timeout / interval))
    conf = {
        # c10d assigns ranks by arrival (torchrun ignores --node-rank with it); the node rank says
        # who hosts the rendezvous store, so two "nodes" on one machine do not race for the port
        "is_host": "1" if ns.node_rank == 0 else "0",
        "join_timeout": ns.join_timeout,
        "last_call_timeout": ns.last_call,
        "keep_alive_interval": interval,
        "keep_alive_max_attempt": attempts,
    }
    return ",".join(f"{k}={v}" for k, v in conf.items())


def is_elastic(ns: argparse.Namespace) -> bool:
    """Ranks may restart (after a failure or a membership change): they need a checkpoint to resume."""
    low, high = ns.nnodes
    return ns.max_restarts > 0 or low < high


# -- the launcher side: when the agent restarted the group ---------------------------------------
class RestartRecorder:
    """Turns torchelastic's agent metrics into the restart record restarted ranks inherit.

    Every monitoring pass the agent publishes ``workers.<role>.remaining_restarts`` and then its
    group's state (``workers.<role>.failed`` or ``unhealthy`` when it failed); a restart then
    publishes the duration of ``_stop_workers`` and of ``_rendezvous``, a restart for a new node
    only those two. All of them come before the agent starts the next workers, which copy the
    launcher's environment when they start. The launcher also says on stderr what it is doing:
    torchrun logs restarts at INFO, which it does not show.
    """

    def __init__(self, out=None) -> None:
        self.failed_at: float | None = None
        self.remaining: int | None = None
        self.restart: dict[str, Any] | None = None
        self.out = out

    def emit(self, metric) -> None:
        name, when, value = metric.name, metric.timestamp, metric.value
        if name.startswith("workers.") and name.endswith(".remaining_restarts"):
            self.remaining = value
        elif name.startswith("workers.") and name.endswith((".failed", ".unhealthy")) and value:
            self.failed_at = self.failed_at or when
        elif name.endswith("_stop_workers.duration.ms"):
            failed, self.failed_at = self.failed_at, None
            if failed is not None and not self.remaining:
                self._say("this node's ranks failed and no restart is left (--max-restarts): the job ends")
                return
            # membership: the rendezvous has nodes waiting (new ones, or peers whose ranks failed first)
            cause = "failure" if failed is not None else "membership"
            started = failed if failed is not None else when - value / 1000
            self.restart = {"cause": cause, "at": started, "stopped_s": round(value / 1000, 3)}
            self._publish()
            if failed is not None:
                self._say(
                    f"this node's ranks failed; restarting them ({self.remaining - 1} restart(s) left after this)"
                )
            else:
                self._say("the rendezvous has nodes waiting (new, or peers that failed): restarting at the new size")
        elif name.endswith("_rendezvous.duration.ms") and self.restart is not None:
            self.restart["rendezvous_s"] = round(value / 1000, 3)
            self._publish()
            self._say(f"rendezvous done in {value / 1000:.1f} s; the ranks resume from the last checkpoint")

    def _publish(self) -> None:
        os.environ[RESTART_ENV] = json.dumps(self.restart)

    def _say(self, text: str) -> None:
        print(f"composable_atorch launch: {text}", file=self.out or sys.stderr, flush=True)


def install_recorder() -> RestartRecorder:
    """Route torchelastic's agent metrics (group ``torchelastic``) through a RestartRecorder."""
    from torch.distributed.elastic import metrics

    recorder = RestartRecorder()

    class Handler(metrics.MetricHandler):
        def emit(self, metric_data) -> None:
            recorder.emit(metric_data)

    # a first round's ranks resume too when their node joins a running job (or the whole job is
    # started again): their clock starts with this launcher
    os.environ[RESTART_ENV] = json.dumps({"cause": "start", "at": time.time()})
    metrics.configure(Handler(), group="torchelastic")
    return recorder


# -- node 0 leaves last ---------------------------------------------------------------------------
#: the longest node 0 waits, after its ranks succeeded, for the other nodes to close the rendezvous
#: (they passed the same exit barrier, so they close within a second unless one died just then)
LEAVE_WAIT_S = 30.0
_LEFT_KEY = "composable_atorch/closed"


@dataclass
class _Leaving:
    """What the wrapped agent and rendezvous methods of this launcher process share."""

    is_host: bool
    succeeded: bool = False
    #: rendezvous handler -> (store, number of nodes) of the last round it joined
    rounds: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


_leaving: _Leaving | None = None


def host_leaves_last(is_host: bool) -> None:
    """Keep node 0's rendezvous store up until the other nodes of the last round closed the rendezvous.

    Node 0's agent hosts the c10d rendezvous store in its own process. At the end of a job every
    agent passes torchrun's exit barrier and then closes the rendezvous through that store; node 0
    often got there first, its launcher exited and took the store with it, and a node still closing
    printed a C++ stack trace ("recvVector failed ... Connection was likely closed") and "failed to
    shutdown the rendezvous ... RendezvousConnectionError" at the end of a successful job (1 run in
    6 of the elastic test here). Now every other node counts itself in the round's store once it
    closed, and node 0, when its ranks succeeded, closes only once they all did (at most
    ``LEAVE_WAIT_S``). After a failure node 0 closes at once, as torchrun does, so the others stop.
    Wraps three public methods of torchrun's agent and c10d rendezvous, in this process only.
    """
    global _leaving
    first = _leaving is None
    _leaving = _Leaving(is_host)
    if first:
        _wrap_agent_and_rendezvous()


def _wrap_agent_and_rendezvous() -> None:
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    run, next_rendezvous, shutdown = (
        SimpleElasticAgent.run,
        DynamicRendezvousHandler.next_rendezvous,
        DynamicRendezvousHandler.shutdown,
    )

    def run_noting_success(self, *args, **kwargs):
        result = run(self, *args, **kwargs)
        _leaving.succeeded = result is not None and not result.is_failed()  # None: a graceful exit
        return result

    def next_rendezvous_remembered(self):
        info = next_rendezvous(self)
        _leaving.rounds[self] = (info.store, info.world_size)
        return info

    def shutdown_in_order(self):
        store, nodes = _leaving.rounds.get(self, (None, 1))
        if store is not None and _leaving.is_host and _leaving.succeeded:
            _wait_for_closed(store, nodes - 1, LEAVE_WAIT_S)
        closed = shutdown(self)
        if store is not None and not _leaving.is_host:
            with contextlib.suppress(Exception):  # node 0 gone (it gave up waiting): nothing to tell
                store.add(_LEFT_KEY, 1)
        return closed

    SimpleElasticAgent.run = run_noting_success
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous_remembered
    DynamicRendezvousHandler.shutdown = shutdown_in_order


def _wait_for_closed(store, others: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while others > 0 and time.monotonic() < deadline:
        try:
            if store.add(_LEFT_KEY, 0) >= others:
                return
        except Exception:  # the store itself failed: nothing left to wait for
            return
        time.sleep(0.05)

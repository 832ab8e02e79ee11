"""A heartbeat that names the rank that stopped, and a collective timeout the user sets.

gloo waits 30 minutes (torch's default process-group timeout) on a peer that stopped: a rank
frozen by SIGSTOP, a swapped-out or lost machine keeps every other rank, and the job, alive that
long and says nothing about who is missing. Two things shorten and explain that:

* a heartbeat thread per rank bumps a counter in the rendezvous store every few seconds and
  watches the others'. A counter that has not moved for the heartbeat's wait (default
  :data:`DEFAULT_HEARTBEAT_S`; ``launch --heartbeat``, ``$COMPOSABLE_ATORCH_HEARTBEAT``) names
  its rank and host: the rank prints which peer stopped and exits non-zero, so torchrun ends (or
  restarts) the job about a minute after a rank stops. The thread runs while a collective blocks
  the main thread, so the rank that stopped is named even when every other rank is waiting
  inside gloo;
* the process group's timeout (``init_distributed(timeout_s=)``, ``parallel_mode(timeout_s=)``,
  ``launch --timeout``; default :data:`DEFAULT_TIMEOUT_S`): a collective waiting longer fails. A
  rank that is alive but loops forever in Python keeps beating; the collective timeout catches
  that one. The heartbeat's wait is never more than half of it, so the heartbeat speaks first.

What it costs: one thread per rank that wakes every ``wait / 10`` seconds (at most 5 s) and makes
one store call for its own counter and one per peer; on the default 45 s that is ``world`` store
calls per rank every 4.5 s (on 1024 ranks about 230 000 calls/s on the store's host, where 2
ranks make under 1/s: set a longer ``--heartbeat`` on very large jobs). A live rank whose
heartbeat thread cannot run for the whole wait (a C extension holding the GIL that long) is
taken for stopped: set a longer wait for such code.

The store client is a private one with a short timeout, so a store whose host stopped (rank 0
hosts it when ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``launch`` sets) is noticed too.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta

from composable_atorch.errors import ConfigError

#: minutes, not gloo's 30: long enough for a slow first step (compilation, a checkpoint load)
DEFAULT_TIMEOUT_S = 300.0
#: the environment variable ``launch --timeout`` sets for every rank
TIMEOUT_ENV = "COMPOSABLE_ATORCH_TIMEOUT"
#: seconds without a peer's heartbeat before it is declared stopped: a stopped rank ends the job
#: within about a minute (this, one beat, torchrun's teardown), where a live rank's heartbeat
#: thread is never held up that long by a training step (it needs the GIL for microseconds)
DEFAULT_HEARTBEAT_S = 45.0
#: the environment variable ``launch --heartbeat`` sets for every rank
HEARTBEAT_ENV = "COMPOSABLE_ATORCH_HEARTBEAT"
#: exit status of a rank that found a stopped peer (EX_SOFTWARE is taken by tracebacks' 1)
EXIT_PEER_STOPPED = 75

#: a rank that ended on purpose (its process exits, its group is destroyed) sets its counter past this
_DONE = 1 << 40

_watchdog: _Watchdog | None = None
_generation = 0
_exit_hook = False


def collective_timeout(timeout_s: float | None = None) -> float:
    """The timeout to use: the argument, else ``$COMPOSABLE_ATORCH_TIMEOUT``, else the default."""
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV)
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            timeout_s = float(text)
        except ValueError:
            raise ConfigError(TIMEOUT_ENV, text, "a number of seconds > 0") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ConfigError("timeout_s", timeout_s, "a number of seconds > 0 (a collective waiting longer fails)")
    return float(timeout_s)


def heartbeat_wait(heartbeat_s: float | None = None, timeout_s: float | None = None) -> float:
    """Seconds without a peer's heartbeat before it is declared stopped: the argument, else
    ``$COMPOSABLE_ATORCH_HEARTBEAT``, else :data:`DEFAULT_HEARTBEAT_S`; at most half the collective
    timeout (so the heartbeat names the rank before a waiting collective fails naming none)."""
    if heartbeat_s is None:
        text = os.environ.get(HEARTBEAT_ENV)
        if text:
            try:
                heartbeat_s = float(text)
            except ValueError:
                raise ConfigError(HEARTBEAT_ENV, text, "a number of seconds > 0") from None
        else:
            heartbeat_s = DEFAULT_HEARTBEAT_S
    if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, int | float) or not heartbeat_s > 0:
        raise ConfigError("heartbeat_s", heartbeat_s, "a number of seconds > 0 (a peer silent longer is stopped)")
    return min(float(heartbeat_s), collective_timeout(timeout_s) / 2)


class _Watchdog(threading.Thread):
    """One process group's heartbeat. It holds neither the group nor its store: either would keep
    rank 0's TCP store server listening after the group is destroyed, and the next group's
    rendezvous on the same port (``reset_distributed(); init_distributed()`` in one process, as
    ATorch's tests do) would then hang in ``init_process_group``. The group is a weak reference,
    the store an address."""

    def __init__(
        self, timeout_s: float, rank: int, world: int, store, prefix: str, stale_s: float | None = None, group=None
    ):
        import torch.distributed as dist

        super().__init__(name="composable_atorch-heartbeat", daemon=True)
        self.timeout_s, self.rank, self.world = timeout_s, rank, world
        # stale after the heartbeat's wait (ten missed beats), at most half the collective timeout: the
        # heartbeat names the stopped rank before the waiting collective times out with gloo's message,
        # which names no rank
        self.stale_s = min(timeout_s / 2, stale_s) if stale_s is not None else timeout_s / 2
        self.interval = min(5.0, max(0.2, self.stale_s / 10))
        self.prefix = prefix
        self._group = weakref.ref(group) if group is not None else None
        # a TCP store by its address (see above); a file store has no server to keep alive
        self.address = (store.host, store.port) if isinstance(store, dist.TCPStore) else None
        self.file_store = None if self.address else store
        self.client = None
        self.stopped = threading.Event()
        self.retired = False

    def _store(self):
        """A private client of a TCP store, with a short timeout bounding each call (a store whose host
        stopped would block a shared client for the store's own timeout); a file store has no host that
        can stop and is used as it is."""
        import torch.distributed as dist

        if self.address is None:
            return self.file_store
        wait = timedelta(seconds=max(1.0, self.interval * 2))
        return dist.TCPStore(*self.address, is_master=False, timeout=wait, wait_for_workers=False)

    @property
    def group(self):
        """The process group this heartbeat is for; None once it was destroyed and freed."""
        return self._group() if self._group is not None else None

    def _current(self) -> bool:
        """Whether this watchdog's group is still the default one (it was not destroyed, or destroyed
        and replaced by another between two beats)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return False
        from torch.distributed.distributed_c10d import _get_default_group

        return self._group is None or _get_default_group() is self.group

    def run(self):
        try:
            store = self.client = self._store()
        except Exception:  # noqa: BLE001 - no store reachable: the collective timeout remains
            return
        if self._beat(store):  # its group destroyed or replaced: nothing of it is kept alive (a file
            self.client = self.file_store = None  # store's file is removed when its last user goes)

    def _beat(self, store) -> bool:
        """Beat until stopped; True when the group was destroyed or replaced (not at exit)."""
        with contextlib.suppress(Exception):  # where this rank runs, for a peer's message if it stops
            store.set(f"{self.prefix}host/{self.rank}", f"host {socket.gethostname()}, pid {os.getpid()}")
        now = time.monotonic()
        seen = {r: (-1, now) for r in range(self.world) if r != self.rank}
        store_ok = now
        while not self.stopped.wait(self.interval):
            now = time.monotonic()
            if not self._current():  # the group was destroyed: this rank is done with it, not lost
                self.done(store)
                return True
            try:
                store.add(f"{self.prefix}{self.rank}", 1)
                counts = {r: store.add(f"{self.prefix}{r}", 0) for r in seen}
            except Exception:  # noqa: BLE001 - a store that does not answer is a stopped host
                if not self._current():  # ... unless its group was destroyed meanwhile
                    return True
                if time.monotonic() - store_ok > self.stale_s:
                    where = "{}:{}".format(*self.address) if self.address else ""
                    self._fail(f"the rendezvous store {where} (rank 0 hosts it unless torchrun's agent does)")
                continue
            store_ok = now
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
            late = sorted(r for r, (c, since) in seen.items() if c < _DONE and now - since > self.stale_s)
            if late:
                where = "; ".join(f"rank {r}: {self._host(store, r)}" for r in late)
                self._fail(f"rank {late[0]}" if len(late) == 1 else f"ranks {late}", where)
        # stopped by done() at exit, which told the peers itself: no store call and no C++ object freed
        # from this daemon thread while the interpreter finalizes (a thread taking the GIL back inside a
        # C++ call then is ended by pthread_exit, and unwinding a C++ frame so aborts the process)
        if self.retired:  # replaced for a new group: a peer still watching this one must not blame this rank
            self.done(store)
        return self.retired

    def retire(self) -> None:
        """Stop for a new group; the thread tells the peers this rank is done with this one."""
        self.retired = True
        self.stopped.set()

    def _host(self, store, rank: int) -> str:
        try:
            return store.get(f"{self.prefix}host/{rank}").decode()
        except Exception:  # noqa: BLE001 - it stopped before saying where it runs
            return "host unknown"

    def done(self, store=None) -> None:
        """Tell the others this rank ended on purpose, so a peer still working does not blame it."""
        self.stopped.set()
        try:
            (store or self.client or self._store()).add(f"{self.prefix}{self.rank}", _DONE)
        except Exception:  # noqa: BLE001 - nobody left to tell
            pass

    def _fail(self, who: str, where: str = "") -> None:
        print(
            f"composable_atorch: {who} stopped responding ({where or 'host unknown'}): no heartbeat for "
            f"{self.stale_s:g} s (stopped, frozen or lost). Rank {self.rank} on {socket.gethostname()} exits so "
            f"the job ends instead of hanging. Set the wait with launch --heartbeat SECONDS "
            f"(${HEARTBEAT_ENV}; at most half the collective timeout, {self.timeout_s:g} s, launch --timeout).",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER_STOPPED)


def torch_default_timeout() -> float:
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout.total_seconds()


def _group_timeout(group) -> float | None:
    """The group's current collective timeout in seconds (gloo's options), None when unknown."""
    import torch

    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def watch(timeout_s: float | None = None) -> float:
    """Set the default group's timeout and start this rank's heartbeat (once per process group).

    The timeout is ``timeout_s``, else ``$COMPOSABLE_ATORCH_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S` in
    place of torch's 30-minute default (a timeout the user gave ``init_process_group`` is kept then).
    Returns the timeout in seconds. Without an initialized process group nothing happens; in a
    world of one there is no peer to watch.
    """
    global _watchdog, _generation
    import torch.distributed as dist

    chosen = timeout_s is not None or bool(os.environ.get(TIMEOUT_ENV))
    timeout = collective_timeout(timeout_s)
    if not (dist.is_available() and dist.is_initialized()):
        return timeout
    from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

    group = _get_default_group()
    current = _group_timeout(group)
    if current is None:  # no gloo backend to set it on (a fake or custom group): the heartbeat still runs
        pass
    elif chosen or current >= torch_default_timeout():
        _set_pg_timeout(timedelta(seconds=timeout), group)
    else:  # a timeout the user gave init_process_group is kept
        timeout = current
    if _watchdog is not None and _watchdog.group is group and _watchdog.is_alive():
        _watchdog.timeout_s = timeout
        _watchdog.stale_s = min(_watchdog.stale_s, timeout / 2)
        return timeout
    if dist.get_world_size() < 2:
        return timeout
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore | dist.FileStore):
        # the estimate's fake process group (one process plays every rank) or threads sharing a
        # HashStore: no peer process to watch, and its silent "ranks" must not be reported as stopped
        return timeout
    if _watchdog is not None and _watchdog.group is group:
        prefix = _watchdog.prefix  # the same group's heartbeat again (its thread ended): the same keys
    else:
        # a fresh key space per restart round and per group. Every rank counts the default groups it
        # watches alike (creating and destroying one is collective); a restarted thread of the same
        # group (above) must not count, or this rank would beat under keys its peers never read
        _generation += 1
        prefix = f"composable_atorch/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_generation}/"
    if _watchdog is not None:
        _watchdog.retire()
    _watchdog = _Watchdog(
        timeout, dist.get_rank(), dist.get_world_size(), store, prefix, heartbeat_wait(timeout_s=timeout), group
    )
    _watchdog.start()
    global _exit_hook
    if not _exit_hook:  # one hook for the process, for whichever heartbeat is current at exit
        atexit.register(_done_at_exit)
        _exit_hook = True
    return timeout


def _done_at_exit() -> None:
    """Tell the peers this rank ended on purpose, and let the thread end before the interpreter
    finalizes: one caught inside a store call then would abort the process (see ``_Watchdog._beat``).

    Then free the cyclic garbage while the interpreter is whole. A DDP module and its optimizer stay
    in reference cycles after the user's function returns (plain torch's too), holding the gloo
    group past ``destroy_process_group()``. Left to the interpreter's finalization, the group is
    freed there, where a gloo worker thread that releases a tensor and needs the GIL is ended by
    ``pthread_exit`` inside a C++ frame and aborts the rank, as pytorch/pytorch#179291 describes
    (seen here: "terminate called without an active exception", SIGABRT after all of its work was
    done, about once in 70 runs of a spawned user script; none in 48 with this collection)."""
    if _watchdog is not None and _watchdog.is_alive():
        _watchdog.done()
        _watchdog.join(timeout=2.0)
    gc.collect()

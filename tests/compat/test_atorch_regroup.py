"""ATorch's ``reset_distributed(); init_distributed()`` in one process, round after round.

ATorch's tests end each case with ``atorch.reset_distributed()`` and the next one starts with
``atorch.init_distributed(...)`` in the same process, while the last case's wrapped model may still
be alive. Anything holding a destroyed group (DDP, FSDP, a device mesh, this library's heartbeat)
keeps rank 0's rendezvous server on ``MASTER_PORT`` alive, and a new rendezvous on that port hung in
``init_process_group`` on one rank (the ATorch ``use_sp`` world-2 fixture failed CI that way: one rank
waiting in a collective, the other in ``init_process_group``, until the heartbeat ended both).

The first check fails (times out) without :func:`composable_atorch.runtime.mesh.init_distributed`'s key
prefix per group; the second with the heartbeat holding its group strongly.
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import composable_atorch.compat.atorch as atorch
from composable_atorch.runtime import liveness, mesh

from _dist import run_world

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = pytest.mark.serial

ROUNDS = 5


def _rounds_holding_models(rank, world, _):
    """Each round wraps a model in DDP (it holds the group) and keeps it; one sum per round."""
    held, sums = [], []
    for i in range(ROUNDS):
        atorch.init_distributed("gloo")  # round 0: the group run_world made is kept as it is
        model = DDP(nn.Linear(2, 2))
        held.append(model)
        x = torch.tensor([float(rank + 10 * i)])
        dist.all_reduce(x)
        sums.append(x.item())
        atorch.reset_distributed()
    return sums


@pytest.mark.dist
def test_rounds_of_reset_and_init_with_old_models_alive():
    results = run_world(_rounds_holding_models, 2, None, timeout=120)
    expected = [float(0 + 1 + 20 * i) for i in range(ROUNDS)]
    assert results == [expected, expected]


def _rounds_with_a_slow_rank(rank, world, _):
    """The library's init with torch's own destroy, and a one-second heartbeat: rank 1 sleeps past it
    in every round, between init and the first collective. Its heartbeat keeps beating under the
    keys rank 0 watches (the same generation on both ranks), and the last round's heartbeat, its
    group destroyed, does not report the gone store as a stopped host: no rank exits 75."""
    os.environ[liveness.HEARTBEAT_ENV] = "1"
    refs, sums = [], []
    for i in range(ROUNDS):
        mesh.init_distributed("gloo")
        from torch.distributed.distributed_c10d import _get_default_group

        refs.append(weakref.ref(_get_default_group()))
        if rank == 1:
            time.sleep(1.5)
        x = torch.tensor([float(i)])
        dist.all_reduce(x)
        sums.append(x.item())
        dist.destroy_process_group()  # torch's own: nothing kept, a new rendezvous on the same port
    time.sleep(1.5)  # the last heartbeat sees its group gone, and ends quietly
    gc.collect()
    # nothing of this library keeps a destroyed group alive (the heartbeat holds it weakly)
    alive = [i for i, ref in enumerate(refs) if ref() is not None]
    return sums, alive, liveness._watchdog is None or not liveness._watchdog.is_alive()


@pytest.mark.dist
def test_heartbeats_agree_across_rounds_and_hold_no_group():
    results = run_world(_rounds_with_a_slow_rank, 2, None, timeout=120)
    for sums, alive, quiet in results:
        assert sums == [2.0 * i for i in range(ROUNDS)]
        assert alive == []
        assert quiet

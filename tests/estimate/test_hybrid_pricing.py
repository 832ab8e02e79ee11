"""estimate.hybrid: hybrid vs flat sharding priced with two link speeds, per-rank memory per zero degree."""

from __future__ import annotations

import pytest

from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError
from composable_atorch.estimate.hybrid import Links, format_table, hybrid_row, hybrid_table

ENV = Environment(world_size=64, nodes=8, device="cuda")
SLOW_INTER = Links(intra_bytes_s=100e9, inter_bytes_s=10e9)


def test_every_zero_degree_with_memory_and_which_link_it_crosses():
    rows = {r.zero: r for r in hybrid_table(1e9, ENV, SLOW_INTER)}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32, 64]
    flat, hybrid, ddp = rows[64], rows[8], rows[1]
    assert flat.data == 1 and flat.replica_all_reduce_s == 0 and "zero-group" in flat.crosses_nodes
    assert hybrid.crosses_nodes == "replica all-reduce"  # a zero group of 8 is one node
    assert ddp.gather_s == 0 and ddp.reduce_scatter_s == 0
    # per-rank state shrinks with the shard degree: 1e9 params x (4 + 4 + 8) bytes / zero
    assert hybrid.state_bytes == pytest.approx(16e9 / 8)
    assert flat.state_bytes == pytest.approx(16e9 / 64)
    # hand-checked: gathers 2 x 7/8 x 4 GB / 100 GB/s, reduce-scatter 7/8 x 4 / 100, all-reduce 2 x 7/8 x 0.5 / 10
    assert hybrid.comm_s == pytest.approx(0.07 + 0.035 + 0.0875)
    assert flat.comm_s == pytest.approx(3 * 63 / 64 * 4e9 / 10e9)
    assert hybrid.comm_s < flat.comm_s  # inter-node traffic dominates: hybrid wins
    assert "zero" in format_table(list(rows.values()))


def test_one_link_speed_still_prices_the_bytes_and_zero2_gathers_once():
    same = Links(50e9, 50e9)
    rows = {r.zero: r for r in hybrid_table(1e9, Environment(world_size=4, nodes=2), same)}
    # flat: 3 x 3/4 x 4 GB = 9 GB; zero 2 x data 2: 3 x 1/2 x 4 GB + 2 x 1/2 x 2 GB = 8 GB; at 50 GB/s
    assert rows[4].comm_s == pytest.approx(0.18) and rows[2].comm_s == pytest.approx(0.16)
    assert rows[2].state_bytes == 2 * rows[4].state_bytes  # the price of fewer bytes: twice the memory
    z2 = hybrid_row(1e9, 4, 2, 2, same, reshard_after_forward=False)
    assert z2.gather_s == pytest.approx(rows[2].gather_s / 2)
    assert z2.param_bytes == 4e9  # zero2 keeps parameters whole


def test_bad_figures_are_typed_errors():
    with pytest.raises(ConfigError, match="bytes per second"):
        Links(0, 1e9)
    with pytest.raises(ConfigError, match="divisor"):
        hybrid_row(1e9, 8, 2, 3, SLOW_INTER)


def test_the_simulated_step_prices_hybrid_collectives_at_their_group_size(monkeypatch):
    """zero 2 x data 2 at world 4: the gathers and reduce-scatters run in zero groups of 2, the
    all-reduce across 2 replicas; none is priced as a ring of the whole world."""
    import torch

    import composable_atorch as ca
    from composable_atorch.estimate import estimate, steptime
    from composable_atorch.models import Block

    from helpers import tiny_gpt

    seen: list = []
    price = steptime.OpTrace.price

    def spy(self, cal, world=2):
        seen.extend(self.ops)
        return price(self, cal, world)

    monkeypatch.setattr(steptime.OpTrace, "price", spy)
    plan = ca.compose(
        ca.parallel_mode([("zero", 2), ("data", 2)]), ca.fsdp(wrap=(Block,)), env=Environment(world_size=4)
    )
    estimate(plan, lambda: tiny_gpt(0, seq_len=16, d_model=32), torch.Size([8, 16]), world_size=4, device="cpu")
    groups = {(kind, group) for kind, group, _ in seen if kind in steptime.COMM_KINDS}
    assert {("all_gather", "2"), ("reduce_scatter", "2"), ("all_reduce", "2")} <= groups
    assert all(group == "2" for _, group in groups)


def test_environment_nodes_from_torchrun_and_kept_per_node_on_a_new_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    env = Environment.detect()
    assert (env.nodes, env.processes_per_node) == (2, 2)
    assert "2 nodes x 2 processes" in env.describe()
    assert env.with_(world_size=8).nodes == 4 and env.with_(world_size=3).nodes == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # uneven: one node
    assert Environment.detect().nodes == 1

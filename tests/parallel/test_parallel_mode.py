"""parallel_mode: the seed's layout arithmetic on paper (no processes) and on a real world-4 group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.layout import plan_layout

from _dist import run_world


def test_seed_16_rank_example_on_paper():
    layout = plan_layout([("tensor", 4), ("pipeline", 2), ("data", 2)], 16)
    assert layout.groups("tensor") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.groups("data") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert layout.mesh_dim_names == ("data", "pipeline", "tensor") and layout.mesh_shape == (2, 2, 4)


@pytest.mark.parametrize(
    "groups, world, expected",
    [
        (None, 16, (("data", 16),)),
        ([("data", 8)], 16, (("data", 16),)),
        ([("tensor", 2), ("pipeline", 2), ("data", 2)], 16, (("tensor", 2), ("pipeline", 2), ("data", 4))),
        ([("tensor", 2), ("pipeline", 2)], 4, (("tensor", 2), ("pipeline", 2))),
        ([("data", 2)], 1, (("data", 1),)),
    ],
)
def test_data_size_is_adjusted_as_the_seed_describes(groups, world, expected):
    assert plan_layout(groups or [("data", 1)], world).dims == expected


@pytest.mark.parametrize(
    "groups, world, shown",
    [
        ([("tensor", 3), ("data", 2)], 16, "tensor 3 = 3, and 16 / 3 is not an integer"),
        ([("tensor", 2), ("pipeline", 2)], 8, "tensor 2 x pipeline 2 = 4, not 8"),
        ([("tensor", 32), ("data", 1)], 16, "16 / 32 is not an integer"),
        ([("tensr", 2)], 2, "one of data, zero, tensor, pipeline"),
        ([("data", 0)], 2, "an integer >= 1"),
        ([("data", 2), ("data", 2)], 4, "each dimension named once"),
    ],
)
def test_impossible_layouts_are_config_errors_showing_the_arithmetic(groups, world, shown):
    with pytest.raises(ConfigError) as info:
        plan_layout(groups, world)
    assert shown in str(info.value)


def test_errors_come_from_compose_before_any_work():
    with pytest.raises(ConfigError, match="not an integer"):
        ca.compose(ca.parallel_mode([("tensor", 3), ("data", 1)]), env=ca.Environment(world_size=4))
    with pytest.raises(ConfigError, match="permutation"):
        ca.compose(ca.parallel_mode([("data", 2)], rank_order=[0, 0]), env=ca.Environment(world_size=2))


def test_rank_order_permutes_the_mesh_on_paper():
    layout = plan_layout([("tensor", 2), ("data", 2)], 4, rank_order=[0, 2, 1, 3])
    assert layout.groups("tensor") == [[0, 2], [1, 3]]
    assert layout.groups("data") == [[0, 1], [2, 3]]


def test_seed_forms_and_json_round_trip():
    env = ca.Environment(world_size=16)
    pm = ca.registry()["parallel_mode"].from_seed(([("tensor", 2), ("pipeline", 2), ("data", 2)], None))
    plan = ca.compose(pm, env=env)
    assert plan.transforms[0].groups == (("tensor", 2), ("pipeline", 2), ("data", 4))
    assert "tensor 2 x pipeline 2 x data 4 = world 16" in plan.explain()
    assert ca.Plan.from_json(plan.to_json(), env=env) == plan
    assert ca.strategy.load(
        ["parallel_mode", ("zero2", {"not_use_fsdp": True})], env=env.with_(packages={"fairscale"})
    ).names == (
        "parallel_mode",
        "zero2",
    )


def test_zero_dim_is_hybrid_sharding_and_its_order_is_checked():
    env = ca.Environment(world_size=4)
    plan = ca.compose(ca.parallel_mode([("zero", 2), ("data", 1)]), ca.fsdp(), env=env)
    assert plan.names == ("parallel_mode", "fsdp")
    with pytest.raises(ca.errors.ConflictError, match="before \\('data', m\\)"):
        ca.compose(ca.parallel_mode([("data", 2), ("zero", 2)]), ca.fsdp(), env=env)


def _world4(rank, world):
    out = {}
    for groups, order in (([("tensor", 2), ("data", 2)], None), ([("tensor", 2), ("data", 2)], [0, 2, 1, 3])):
        state = ca.compose(ca.parallel_mode(groups, order), ca.ddp()).apply(
            __import__("_dp").model(), None, __import__("_dp").loader(batch=8)
        )
        pc = state.parallel
        key = "ordered" if order else "plain"
        out[key] = {
            "mesh_names": pc.mesh.mesh_dim_names,
            "tensor_ranks": dist.get_process_group_ranks(pc.mesh["tensor"].get_group()),
            "data_ranks": dist.get_process_group_ranks(pc.data_group()),
            "data_rank": pc.data_rank,
            "per_rank_batch": state.loader.batch_size,
            "layout_tensor": pc.layout.groups("tensor"),
            "layout_data": pc.layout.groups("data"),
        }
    return out


@pytest.mark.dist
def test_world4_groups_match_the_layout():
    results = run_world(_world4, 4, timeout=300)
    for rank, r in enumerate(results):
        for key in ("plain", "ordered"):
            got = r[key]
            assert got["mesh_names"] == ("data", "tensor")
            assert got["tensor_ranks"] in got["layout_tensor"] and rank in got["tensor_ranks"]
            assert got["data_ranks"] in got["layout_data"] and rank in got["data_ranks"]
            assert got["per_rank_batch"] == 4  # global 8 over data size 2
        assert r["plain"]["tensor_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["ordered"]["layout_tensor"] == [[0, 2], [1, 3]]

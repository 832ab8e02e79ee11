"""The search space: generated from the registry and candidates, with compose() as the constraint."""

from dataclasses import dataclass

import pytest
import torch

import composable_atorch as ca
from composable_atorch.auto.space import ABSENT, SearchSpace, block_classes, dimensions, plan_key
from composable_atorch.core.contract import Conflict, Contract, Stage
from composable_atorch.core.transform import SearchContext, Transform
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, UnknownTransformError
from composable_atorch.models import GPT, MLP, Block, CausalSelfAttention
from composable_atorch.units import parse_bytes

ENV2 = Environment.detect().with_(world_size=2)


def context(world=2, batch=16):
    return SearchContext(
        env=ENV2.with_(world_size=world), block_classes=block_classes(GPT(n_layer=2)), batch_size=batch
    )


def test_block_classes_are_the_repeated_user_modules_outermost_first():
    assert block_classes(GPT(n_layer=2)) == (Block, CausalSelfAttention, MLP)
    assert block_classes(GPT(n_layer=1)) == ()


def test_every_kind_with_candidates_is_searched_and_no_other():
    ctx = context()
    space = SearchSpace(ctx)
    searched = {k for knob in space.kinds for k in knob.split("+")}
    offering = {name for name, cls in ca.registry().items() if cls.candidates(ctx)}
    assert searched == offering
    # each knob's options are exactly absent + what its kinds offer (or valid combinations of them)
    for knob, choices in space.options.items():
        # "absent", or (where compose() implies the knob's default, as data parallelism at world 2)
        # the option that plan is listed under
        assert ABSENT in choices or space.implied_label(knob) in choices, knob
        for combo in choices.values():
            assert {t.name for t in combo} <= set(knob.split("+"))


def test_world_one_drops_the_kinds_that_need_two_processes():
    ctx1, ctx2 = context(world=1), context(world=2)
    at1 = {k for knob in SearchSpace(ctx1).kinds for k in knob.split("+")}
    need_two = {n for n, cls in ca.registry().items() if cls.candidates(ctx2) and not cls.candidates(ctx1)}
    assert not (at1 & need_two)


def test_every_enumerated_plan_composes_and_every_rejected_one_raises():
    space = SearchSpace(context())
    e = space.enumerate()
    assert len(e.valid) > 0 and e.total == space.size
    for key, point in e.valid.items():
        again = ca.compose(*space.transforms(dict(point.assignment)), env=ENV2)
        assert plan_key(again) == key
    # distinct keys are distinct plans: no plan is measured twice
    assert len({plan_key(p.plan) for p in e.valid.values()}) == len(e.valid)
    for label, reason in space.rejected:
        assert "Error" in reason and label


@dataclass(frozen=True)
class _A(Transform):
    contract = Contract(stage=Stage.DATA_PARALLEL, owns=("sync",))


@dataclass(frozen=True)
class _B(Transform):
    contract = Contract(stage=Stage.DATA_PARALLEL, owns=("sync",))


@dataclass(frozen=True)
class _C(Transform):
    contract = Contract(stage=Stage.CHECKPOINT, conflicts=(Conflict("_d", "test", "drop one"),))


@dataclass(frozen=True)
class _D(Transform):
    contract = Contract(stage=Stage.COMPILE)


@dataclass(frozen=True)
class _E(Transform):
    contract = Contract(stage=Stage.OPTIMIZER)


# named after class creation so they stay out of the registry (the matrix covers registered ones)
for _cls, _name in ((_A, "_a"), (_B, "_b"), (_C, "_c"), (_D, "_d"), (_E, "_e")):
    _cls.name = _name


def test_contending_kinds_share_one_knob_read_from_contracts():
    groups = dimensions({"_a": _A, "_b": _B, "_c": _C, "_d": _D, "_e": _E})
    assert sorted(groups) == [("_a", "_b"), ("_c", "_d"), ("_e",)]


def test_excluded_and_included():
    base = SearchSpace(context())
    kind = next(k for knob in base.kinds for k in knob.split("+") if "+" not in knob)
    without = SearchSpace(context(), excluded=[kind])
    assert kind not in without.kinds and without.size < base.size
    pinned = SearchSpace(context(), included=[kind])
    assert ABSENT not in pinned.options[kind]
    assert all(
        any(t.name == kind for t in pinned.transforms(dict(p.assignment))) for p in pinned.enumerate().valid.values()
    )
    # aliases and seed names that are planned but not built are accepted in excluded
    SearchSpace(context(), excluded=["amp_native", "tensor_parallel"])
    with pytest.raises(UnknownTransformError, match="did you mean 'checkpoint'"):
        SearchSpace(context(), excluded=["chekpoint"])
    with pytest.raises(ConfigError, match="offer search candidates"):
        SearchSpace(context(), included=["clip_grad"])
    with pytest.raises(ConfigError, match="not also in excluded"):
        SearchSpace(context(), included=[kind], excluded=[kind])


def test_assignment_of_finds_a_plan_and_extra_configs_join_their_kind():
    space = SearchSpace(context())
    point = next(iter(space.enumerate().valid.values()))
    assert space.assignment_of(point.plan) == dict(point.assignment)
    reentrant = ca.checkpoint(Block, reentrant=True)
    extended = SearchSpace(context(), extra=[reentrant])
    plan = ca.compose(reentrant, env=ENV2)
    assert space.assignment_of(plan) is None
    assignment = extended.assignment_of(plan)
    assert assignment is not None and reentrant in extended.transforms(assignment)
    # the same plan: at world 2 the engine knob stands at the data-parallel default compose() implies
    assert plan_key(extended.point(assignment).plan) == plan_key(plan)


def test_parse_bytes():
    assert parse_bytes("48MiB") == 48 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(1000) == 1000 and parse_bytes(None) is None
    for bad in ("lots", -1, 0, True):
        with pytest.raises(ConfigError, match="memory_limit"):
            parse_bytes(bad)


def test_budget_takes_the_same_units_as_the_estimate():
    # one parser for the search's budget and the estimate's fit test: TiB works in both
    from composable_atorch.auto.policy import Budget

    assert Budget(memory_limit="1TiB").memory_bytes == 2**40
    assert Budget(memory_limit="2TB").memory_bytes == 2 * 10**12
    assert parse_bytes("1TiB", "limit_bytes", required=True) == 2**40
    with pytest.raises(ConfigError, match="limit_bytes"):
        parse_bytes(None, "limit_bytes", required=True)


class _Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def test_module_replace_is_refused_at_no_cost_where_the_model_holds_nothing_it_replaces():
    """Nothing to replace: the plan would train exactly as without the step, so the search's planning
    check refuses it (half the space would be copies); a model holding a replaceable module keeps it."""
    from composable_atorch.auto.space import planning_admit

    def plans_of(model):
        env = Environment.detect().with_(world_size=1)
        context = SearchContext(env=env, block_classes=block_classes(model), batch_size=8)
        return SearchSpace(context, admit=planning_admit(model)).enumerate()

    plain = torch.nn.Sequential(_Dense(), _Dense())
    found = plans_of(plain)
    assert found.valid and not any("module_replace" in p.plan.names for p in found.valid.values())
    refused = [p for p in found.invalid if "module_replace" in (p.error or "")]
    assert refused and "holds none" in refused[0].error
    with pytest.raises(ConfigError, match="holds none"):
        ca.module_replace().check(plain)
    with torch.device("meta"):
        gpt = GPT()  # its attention has registered pairs
    assert ca.module_replace().check(gpt) == []
    assert any("module_replace" in p.plan.names for p in plans_of(gpt).valid.values())

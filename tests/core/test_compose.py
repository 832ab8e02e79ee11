"""compose() and Plan: order independence, associativity, contracts, strictness, JSON, errors."""

import itertools
from dataclasses import dataclass

import pytest
import torch

import composable_atorch as ca
from composable_atorch.core.contract import (
    Conflict,
    Contract,
    DeviceKind,
    Implication,
    MinComputeCapability,
    MinWorldSize,
    Order,
    Package,
    Stage,
)
from composable_atorch.core.transform import Transform, register, registry_scope
from composable_atorch.environment import Environment
from composable_atorch.errors import (
    CompositionError,
    ConfigError,
    ConflictError,
    RequirementError,
    UnknownTransformError,
)
from composable_atorch.models import Block

CPU = Environment(world_size=1, device="cpu")


def _all():
    return [ca.checkpoint(Block), ca.amp("bf16"), ca.clip_grad(1.0), ca.accumulate(2), ca.half("bf16")]


def test_order_independent_and_associative():
    ts = _all()
    plans = [ca.compose(*perm, env=CPU) for perm in itertools.permutations(ts)]
    assert all(p == plans[0] for p in plans)
    assert all(p.explain() == plans[0].explain() for p in plans)
    a, b, c = ts[:3]
    assert (a | b) | c == a | (b | c) == c | b | a
    assert a | b == b | a


def test_canonical_order_follows_stages():
    plan = ca.compose(*_all(), env=CPU)
    stages = [t.contract.stage for t in plan.transforms]
    assert stages == sorted(stages)
    assert plan.names == ("half", "checkpoint", "amp", "accumulate", "clip_grad")
    text = plan.explain()
    for name in plan.names:
        assert name in text
    assert "stage 5 (checkpoint)" in text


def test_duplicates_merge_but_different_configs_conflict():
    assert ca.compose(ca.amp("bf16"), ca.amp(torch.bfloat16), env=CPU).names == ("amp",)
    with pytest.raises(ConflictError, match="same kind"):
        ca.compose(ca.clip_grad(1.0), ca.clip_grad(2.0), env=CPU)


def test_amp_half_conflict_only_for_different_dtypes():
    assert ca.compose(ca.amp("bf16"), ca.half("bf16"), env=CPU).names == ("half", "amp")
    with pytest.raises(ConflictError) as err:
        ca.compose(ca.amp("fp16"), ca.half("bf16"), env=CPU)
    assert "amp(fp16" in str(err.value) and "half(bf16)" in str(err.value) and "Fix:" in str(err.value)


# -- toy transforms exercising every contract feature -------------------------------------------
# Registered under names starting with "toy_" and removed after the module's tests.


#: The toy transforms below register (as every Transform subclass does) inside this scope, closed right
#: after them: importing this module leaves the registry as it was (pytest imports every test module
#: before it runs any; a file run after this one in another process must not see the toys). The module
#: fixture registers them for this file's tests alone.
_TOY_SCOPE = registry_scope()
_TOY_SCOPE.__enter__()


@dataclass(frozen=True)
class ToyGroup(Transform):
    name = "toy_group"
    contract = Contract(stage=Stage.DATA_PARALLEL, roles=("toy_groups",))

    def apply(self, state, ctx):
        state.note(self.name, "made groups")
        return state


@dataclass(frozen=True)
class ToySync(Transform):
    name = "toy_sync"
    contract = Contract(
        stage=Stage.OPTIMIZER,
        owns=("toy_grad_sync",),
        implies=(Implication("toy_group", "needs a group to sync over"),),
    )

    def apply(self, state, ctx):
        return state


@dataclass(frozen=True)
class ToySync2(Transform):
    name = "toy_sync2"
    contract = Contract(stage=Stage.OPTIMIZER, owns=("toy_grad_sync",))


@dataclass(frozen=True)
class ToyGpu(Transform):
    name = "toy_gpu"
    contract = Contract(
        stage=Stage.MODULE_REWRITE,
        requires=(
            DeviceKind(kinds=("cuda",), on_unmet="skip"),
            MinComputeCapability(major=8, minor=9, on_unmet="skip"),
        ),
    )

    def apply(self, state, ctx):
        return state


@dataclass(frozen=True)
class ToyUsesGpu(Transform):
    name = "toy_uses_gpu"
    contract = Contract(stage=Stage.OPTIMIZER, implies=(Implication("toy_gpu", "needs the GPU rewrite"),))

    def apply(self, state, ctx):
        return state


@dataclass(frozen=True)
class ToyNeedsWorld(Transform):
    name = "toy_world"
    # owns grad_sync like any data-parallel engine, so world 2 implies no default owner beside it
    contract = Contract(
        stage=Stage.DATA_PARALLEL,
        owns=("grad_sync",),
        requires=(MinWorldSize(minimum=2), Package(name="toypkg", extra="toy")),
    )


@dataclass(frozen=True)
class ToyFirst(Transform):
    """Same stage as checkpoint; by name it would sort after it, an Order rule puts it before."""

    name = "toy_first"
    contract = Contract(
        stage=Stage.CHECKPOINT, orders=(Order("checkpoint", "it must see blocks unwrapped", after=False),)
    )

    def apply(self, state, ctx):
        return state


@dataclass(frozen=True)
class ToyCycle(Transform):
    name = "toy_cycle"
    contract = Contract(stage=Stage.OPTIMIZER, orders=(Order("amp", "contradicts the stage order", after=False),))


@dataclass(frozen=True)
class ToyHater(Transform):
    name = "toy_hater"
    contract = Contract(
        stage=Stage.OPTIMIZER, conflicts=(Conflict("mixed_precision", "toy cannot mix precisions", "drop amp"),)
    )


TOYS = (ToyGroup, ToySync, ToySync2, ToyGpu, ToyUsesGpu, ToyNeedsWorld, ToyFirst, ToyCycle, ToyHater)
_TOY_SCOPE.__exit__(None, None, None)


@pytest.fixture(autouse=True, scope="module")
def _toys_registered():
    with registry_scope():
        for toy in TOYS:
            register(toy)
        yield


def test_implied_step_is_added_and_shown_and_strict_refuses():
    plan = ca.compose(ToySync(), env=CPU)
    assert plan.names == ("toy_group", "toy_sync")
    assert plan.steps[0].implied_by == "toy_sync"
    assert any("implied" in n and "toy_group" in n for n in plan.notes)
    assert "implied by toy_sync" in plan.explain()
    with pytest.raises(RequirementError, match="toy_group"):
        ca.compose(ToySync(), env=CPU, strict=True)
    # satisfied explicitly: no note
    assert not ca.compose(ToySync(), ToyGroup(), env=CPU).notes


def test_exclusive_role_conflict():
    with pytest.raises(ConflictError, match="toy_grad_sync"):
        ca.compose(ToySync(), ToySync2(), ToyGroup(), env=CPU)


def test_conflict_with_role_names_reason_and_fix():
    with pytest.raises(ConflictError) as err:
        ca.compose(ToyHater(), ca.amp("bf16"), env=CPU)
    assert err.value.reason == "toy cannot mix precisions" and err.value.fix == "drop amp"


def test_skip_when_environment_lacks_hardware_and_strict_errors():
    plan = ca.compose(ToyGpu(), ca.amp("bf16"), env=CPU)
    assert plan.names == ("amp",)
    assert any("skipped toy_gpu" in n and "cuda" in n for n in plan.notes)
    assert "skipped toy_gpu" in plan.explain()
    with pytest.raises(RequirementError, match="cuda"):
        ca.compose(ToyGpu(), env=CPU, strict=True)
    h100 = Environment(
        world_size=1, device="cuda", compute_capability=(9, 0)
    )  # world 1: no data-parallel default implied
    assert ca.compose(ToyGpu(), env=h100).names == ("toy_gpu",)
    a100 = h100.with_(compute_capability=(8, 0))
    assert ca.compose(ToyGpu(), env=a100).names == ()


def test_implied_steps_are_checked_against_the_environment_too():
    with pytest.raises(RequirementError, match="toy_gpu.*cannot run"):
        ca.compose(ToyUsesGpu(), env=CPU)
    h100 = Environment(world_size=1, device="cuda", compute_capability=(9, 0))
    plan = ca.compose(ToyUsesGpu(), env=h100)
    assert plan.names == ("toy_gpu", "toy_uses_gpu") and plan.steps[0].implied_by == "toy_uses_gpu"


def test_unmet_hard_requirement_is_error_naming_fix():
    with pytest.raises(RequirementError) as err:
        ca.compose(ToyNeedsWorld(), env=CPU)
    assert "world size of at least 2" in str(err.value) and "launch" in err.value.fix
    with pytest.raises(RequirementError, match="toypkg"):
        ca.compose(ToyNeedsWorld(), env=CPU.with_(world_size=2))
    ok = ca.compose(ToyNeedsWorld(), env=CPU.with_(world_size=2, packages={"toypkg"}))
    assert ok.names == ("toy_world",)


def test_pairwise_order_refines_within_a_stage_and_contradictions_are_errors():
    plan = ca.compose(ToyFirst(), ca.checkpoint(Block), env=CPU)
    assert plan.names == ("toy_first", "checkpoint")
    assert "before checkpoint: it must see blocks unwrapped" in plan.explain()
    with pytest.raises(ConflictError, match="cycle"):
        ca.compose(ToyCycle(), ca.amp("bf16"), env=CPU)


def test_plan_json_roundtrip_and_bad_json():
    plan = ca.compose(*_all(), env=CPU)
    again = ca.Plan.from_json(plan.to_json(), env=CPU)
    assert again == plan and again.explain() == plan.explain()
    with pytest.raises(ConfigError, match="valid JSON"):
        ca.Plan.from_json("{not json", env=CPU)
    with pytest.raises(ConfigError, match="plan format"):
        ca.Plan.from_json('{"format": "other"}', env=CPU)
    data = plan.to_dict()
    data["transforms"][0]["config"]["no_such_field"] = 1
    with pytest.raises(ConfigError, match="no_such_field"):
        ca.Plan.from_dict(data, env=CPU)
    data = plan.to_dict()
    data["transforms"][0]["name"] = "chekpoint"
    with pytest.raises(UnknownTransformError) as err:
        ca.Plan.from_dict(data, env=CPU)
    assert err.value.suggestion == "checkpoint"


def test_unknown_names_suggest_nearest():
    with pytest.raises(UnknownTransformError) as err:
        ca.build("clip_grads")
    assert err.value.suggestion == "clip_grad" and "accumulate" in str(err.value)
    assert isinstance(err.value, CompositionError) and isinstance(err.value, KeyError)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ca.amp("fp32"), "amp.dtype"),
        (lambda: ca.half(torch.float32), "half.dtype"),
        (lambda: ca.accumulate(0), "accumulate.steps"),
        (lambda: ca.accumulate(1.5), "accumulate.steps"),
        (lambda: ca.clip_grad(-1), "clip_grad.max_norm"),
        (lambda: ca.checkpoint(), "checkpoint targets"),
        (lambda: ca.checkpoint(3), "checkpoint target"),
        (lambda: ca.checkpoint({"wrap_class": (Block,), "reentrant": True}), "checkpoint config key"),
        (lambda: ca.compose("amp"), "compose() argument"),
        (lambda: Environment(world_size=0), "Environment.world_size"),
        (lambda: Environment(device="tpu"), "Environment.device"),
    ],
)
def test_config_errors_name_field_and_allowed(make, field):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.field.startswith(field)
    assert "allowed" in str(err.value)


def test_plan_refuses_other_world_size_before_any_work():
    plan = ca.compose(ca.amp("bf16"), env=Environment(world_size=16, device="cuda", compute_capability=(9, 0)))
    model = torch.nn.Linear(4, 4)
    forward = model.forward
    with pytest.raises(RequirementError, match="world size of 16"):
        plan(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.forward == forward  # nothing was applied


def test_plan_rejects_non_module_and_non_optimizer():
    plan = ca.compose(ca.amp("bf16"), env=CPU)
    with pytest.raises(ConfigError, match="model"):
        plan("not a model")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="optim"):
        plan(model, [1, 2])


def test_environment_detect_and_explicit():
    env = Environment.detect()
    assert env.world_size == 1 and env.device == "cpu"
    assert "transformer_engine" not in env.packages  # only an importable package counts
    big = Environment(world_size=16, device="cuda", compute_capability=[9, 0], packages=["deepspeed"])
    assert big.compute_capability == (9, 0) and big.has("deepspeed")
    assert "world 16, cuda sm90" in big.describe()

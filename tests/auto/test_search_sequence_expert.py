"""The search proposes the parallel degrees the model and its batch call for: expert degrees for a
mixture of experts (expert counts divisible by the degree), context and Ulysses degrees for attention
at long sequences, hybrid sharding (zero x data with fsdp / zero2) on several nodes; each legal
(compose() accepts it), each said in one line. A plan the estimate cannot simulate is measured, with
the reason in the trials table; one real study at world 2 on a tiny MoE ends with a plan that trains.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import composable_atorch as ca
from composable_atorch.auto.policy import Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.predict import Prediction, Predictor, StepTimeCheck
from composable_atorch.auto.space import KNOB, build_space, sequence_split
from composable_atorch.auto.study import search
from composable_atorch.auto.trial import TrialResult, run_trial, samples_per_step
from composable_atorch.auto.workload import Workload
from composable_atorch.core.plan import Plan
from composable_atorch.core.transform import lookup
from composable_atorch.data import TextDataset
from composable_atorch.environment import Environment
from composable_atorch.estimate import EstimateError
from composable_atorch.transforms.parallel.sequence.common import LONG_SEQUENCE
from zoo.moe import UserMoEModel
from zoo.sequence import UserLM

from _dist import run_world


def moe_model():
    torch.manual_seed(0)
    return UserMoEModel(vocab=256)


def dense_model(seq: int = 64):
    torch.manual_seed(0)
    return UserLM(max_len=seq)


def lm_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def workload(model_fn, seq: int, batch: int = 4) -> Workload:
    return Workload(model_fn, sgd, TextDataset(seq, limit=4 * batch), lm_loss, batch)


def space_of(model_fn, seq: int, world: int, nodes: int = 1, **options):
    space, _ = build_space(workload(model_fn, seq), Environment(world_size=world, nodes=nodes), SpaceOptions(**options))
    return space


def degree_options(space) -> list[str]:
    return [label for label in space.options.get(KNOB, {}) if label != "absent"]


@pytest.mark.parametrize("world, degrees", [(2, ["expert 2"]), (4, ["expert 2", "expert 4"])])
def test_a_mixture_of_experts_gets_expert_degrees_that_divide_its_experts(world, degrees):
    space = space_of(moe_model, 16, world)
    labels = degree_options(space)
    assert [label.split(" x ")[0] for label in labels] == degrees
    assert all("\n" not in label and "experts" in label for label in labels)  # one line: what it does
    # sequences of 16 tokens: no sequence split, and the description says why
    assert "context_parallel / sequence_parallel not proposed: sequences of 16 tokens" in space.describe()


def test_experts_that_do_not_divide_by_the_degree_are_not_proposed():
    def three_experts():
        model = moe_model()
        for block in model.blocks:
            block.experts.num_experts = 3
        return model

    assert degree_options(space_of(three_experts, 16, 2)) == []


@pytest.mark.parametrize("world", [2, 4])
def test_a_dense_model_at_a_long_sequence_gets_context_and_ulysses_degrees_not_experts(world):
    space = space_of(dense_model, LONG_SEQUENCE, world)
    kinds = {label.split(" ")[0] for label in degree_options(space)}
    assert kinds == {"context", "sequence"}
    sizes = {int(label.split(" ")[1]) for label in degree_options(space)}
    assert sizes == ({2} if world == 2 else {2, 4})
    assert "expert parallelism not proposed: the model has no mixture-of-experts layer" in space.describe()


def test_short_sequences_get_no_sequence_split_unless_included():
    short = functools.partial(dense_model, 16)
    assert degree_options(space_of(short, 16, 2)) == []
    forced = space_of(short, 16, 2, included=("context_parallel",))
    assert "absent" not in forced.options[KNOB]
    assert [label.split(" x ")[0] for label in forced.options[KNOB]] == ["context 2"]


def test_hybrid_sharding_is_proposed_on_two_nodes_only_with_a_sharding_engine():
    assert not any(label.startswith("zero") for label in degree_options(space_of(moe_model, 16, 4)))
    space = space_of(moe_model, 16, 4, nodes=2, excluded=("checkpoint", "amp", "module_replace", "accumulate"))
    hybrid = next(label for label in degree_options(space) if label.startswith("zero 2 x data 2"))
    assert "HSDP" in hybrid
    enumeration = space.enumerate()
    with_hybrid = [p for p in enumeration.valid.values() if dict(p.assignment)[KNOB] == hybrid]
    engines = {next(t.name for t in p.plan.transforms if t.name in ("fsdp", "zero2", "zero1")) for p in with_hybrid}
    assert engines == {"fsdp", "zero2", "zero1"}
    reasons = " ".join(p.error for p in enumeration.invalid if dict(p.assignment)[KNOB] == hybrid)
    assert "shards nothing without fsdp" in reasons  # ddp over zero x data: the plan without it
    assert "fsdp(hybrid=True)" in reasons  # the same HSDP, listed once by its explicit layout


def test_every_proposed_degree_composes_and_explain_says_what_it_does():
    cases = [(moe_model, 16, 4, 2), (dense_model, LONG_SEQUENCE, 4, 1)]
    for model_fn, seq, world, nodes in cases:
        space = space_of(
            model_fn, seq, world, nodes, excluded=("checkpoint", "amp", "module_replace", "accumulate", "zero1")
        )
        enumeration = space.enumerate()
        env = space.env
        for label in degree_options(space):
            plans = [p.plan for p in enumeration.valid.values() if dict(p.assignment)[KNOB] == label]
            assert plans, label
            for plan in plans:
                again = Plan.from_json(plan.to_json(), env=env, allow=plan.named_objects())
                assert again.names == plan.names
                step = next(t for t in plan.transforms if t.name == KNOB)
                assert step.describe() in plan.explain()


def test_a_plan_the_estimate_cannot_simulate_is_measured_not_ruled_out():
    def refuses(plan, model, batch, **_):
        raise EstimateError("context parallelism is not simulated here", "its collectives", "measure it")

    def crashes(plan, model, batch, **_):
        raise RuntimeError("crashed on fake tensors")

    env = Environment(world_size=2)
    dense = workload(dense_model, LONG_SEQUENCE)
    split = ca.compose(ca.parallel_mode([("context", 2), ("data", 1)]), lookup("context_parallel")(), env=env)
    pred = Predictor(refuses, dense, env)(split)  # a typed refusal on a step new to the estimate
    assert pred.measure and not pred.known and "measured instead" in pred.reason
    crashed = Predictor(crashes, dense, env)(split)  # any other error: as before, a plan that may crash
    assert not crashed.measure and "crashed" in crashed.reason
    # after trials, the step-time check never rules out the first for having no prediction
    check = StepTimeCheck()
    for step in (0.1, 0.1):
        check.observe(Prediction(step_time_s=step), TrialResult(status="ok", step_time=step, samples_per_s=1.0))
    assert check.loses(pred) is None
    assert check.loses(crashed) is not None  # unchanged
    # expert_parallel is simulated now (balanced dispatch on fake tensors): the estimate is asked
    experts = ca.compose(ca.parallel_mode([("expert", 2), ("data", 1)]), lookup("expert_parallel")(), env=env)
    asked = Predictor(refuses, workload(moe_model, 16), env)(experts)
    assert asked.measure and "measured instead" in asked.reason and "leaves expert_parallel out" not in asked.reason


def split_experts(rank: int, world: int, plan_json: str) -> dict:
    model, optim, loader = Plan.from_json(plan_json)(*workload(moe_model, 16).build())
    losses = []
    for _, batch in zip(range(2), loader):
        loss = lm_loss(model, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss))
    held = {n: tuple(p.shape) for n, p in model.named_parameters() if "experts" in n}
    return {"losses": losses, "held": held}


@pytest.mark.dist
def test_a_short_study_at_world_2_on_a_moe_measures_expert_parallelism_and_its_plan_trains():
    others = tuple(sorted(set(ca.registry()) - {"expert_parallel", "parallel_mode", "ddp"}))

    def refuses(plan, model, batch, **_):  # a typed refusal: the plan is measured instead
        raise EstimateError("expert parallelism is not simulated", "all-to-all split sizes", "measure it")

    result = search(
        workload(moe_model, 16),
        trial=TrialSettings(world_size=2, warmup_steps=1, measure_steps=2, precision=None, timeout=180),
        budget=Budget(n_trials=1),
        space=SpaceOptions(excluded=others, included=("expert_parallel",)),
        study=StudyOptions(seed=0, sampler="random", preflight=False),
        estimator=refuses,
        progress=False,
    )
    assert list(result.space.options[KNOB]) == [next(iter(result.space.options[KNOB]))]  # pinned: expert 2 only
    (record,) = result.measured
    assert record.status == "ok", record.reason
    assert "measured instead" in record.reason  # the table says why it has no prediction
    assert result.best_plan is not None and "expert_parallel" in result.best_plan.names
    out = run_world(split_experts, 2, result.best_plan.to_json(), timeout=240)
    for rank in out:
        assert all(shape[0] == 2 for shape in rank["held"].values()), rank["held"]  # 2 of 4 experts each
        assert all(loss == loss and loss < 10 for loss in rank["losses"])


def test_a_sequence_split_counts_each_sample_once_not_once_per_part():
    env = Environment(world_size=4)
    context = ca.compose(ca.parallel_mode([("context", 2), ("data", 2)]), lookup("context_parallel")(), env=env)
    implied = ca.compose(lookup("sequence_parallel")(), env=env)
    assert sequence_split(context) == 2 and sequence_split(implied) == 2
    assert sequence_split(ca.compose(ca.parallel_mode([("zero", 2), ("data", 2)]), env=env)) == 1
    ulysses_4 = ca.compose(ca.parallel_mode([("sequence", 4), ("data", 1)]), lookup("sequence_parallel")(), env=env)
    assert sequence_split(ulysses_4) == 4
    # two data ranks of two context parts each: 2 samples per data rank, 4 digests each (halves differ)
    ranks = [
        {"sample_ids": [[f"{s}{part}" for s in "ab" for part in "xy"]]},
        {"sample_ids": [[f"{s}{p}" for s in "cd" for p in "xy"]]},
    ]
    assert samples_per_step(ranks, 4, split=2) == 4


@pytest.mark.dist
def test_a_context_trial_measures_the_global_batch_per_step():
    space = space_of(dense_model, LONG_SEQUENCE, 2, excluded=("checkpoint", "amp", "module_replace", "accumulate"))
    label = next(label for label in degree_options(space) if label.startswith("context 2"))
    point = space.point(
        {**{k: "absent" if "absent" in v else next(iter(v)) for k, v in space.options.items()}, KNOB: label}
    )
    assert point.valid, point.error
    settings = TrialSettings(world_size=2, warmup_steps=1, measure_steps=2, precision=None, timeout=120)
    result = run_trial(point.plan.to_json(), workload(dense_model, LONG_SEQUENCE), settings, point.plan.named_objects())
    assert result.ok, result.reason
    assert result.samples_per_step == 4  # the global batch, though each rank's digests are of half-sequences
    assert result.tokens_per_s == pytest.approx(result.samples_per_s * LONG_SEQUENCE)


def test_included_parallel_mode_pins_the_knob_to_its_degrees():
    space = space_of(moe_model, 16, 4, nodes=2, included=("parallel_mode",))
    assert "absent" not in space.options[KNOB]
    assert {label.split(" ")[0] for label in space.options[KNOB]} == {"expert", "zero"}
    assert "parallel_mode" not in space_of(moe_model, 16, 4, nodes=2, excluded=("parallel_mode",)).options


def test_each_axis_offers_its_own_degrees_from_the_model_facts_and_the_meta_forward_runs_once():
    from composable_atorch.core.context import ForwardProfile, LayoutOption, ModelFacts, NotOffered, SearchContext

    runs = []

    def measure():
        runs.append(1)
        return ForwardProfile(activation_bytes=2**30, heads=(4,))

    def facts(model, length):
        return ModelFacts(model, length, 4, measure)

    env = Environment(world_size=4)
    dense = facts(dense_model(), LONG_SEQUENCE)
    search = SearchContext(env=env, batch_size=4, model=dense)
    context, ulysses = lookup("context_parallel").candidates(search), lookup("sequence_parallel").candidates(search)
    assert [(o.dim, o.degree) for o in context] == [("context", 2), ("context", 4)]
    assert [(o.dim, o.degree) for o in ulysses] == [("sequence", 2), ("sequence", 4)]
    assert all(isinstance(o, LayoutOption) and dict(o.layout.groups)[o.dim] == o.degree for o in context + ulysses)
    assert runs == [1]  # one meta forward for both splits
    (why,) = lookup("expert_parallel").candidates(search)
    assert isinstance(why, NotOffered) and "no mixture-of-experts layer" in why.note
    # short sequences: no split, and the user's forward never runs for it (unless the kind is included)
    short = SearchContext(env=env, batch_size=4, model=facts(dense_model(16), 16))
    (no,) = lookup("context_parallel").candidates(short)
    assert no.note == "context_parallel not proposed: sequences of 16 tokens (split from 64 on)" and runs == [1]
    forced = SearchContext(env=env, batch_size=4, model=short.model, included=frozenset({"context_parallel"}))
    assert [o.degree for o in lookup("context_parallel").candidates(forced)] == [2, 4] and runs == [1, 1]
    # no model facts (a space built without a model): no degrees
    assert lookup("expert_parallel").candidates(SearchContext(env=env, batch_size=4)) == ()

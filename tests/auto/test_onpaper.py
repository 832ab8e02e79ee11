"""The search on paper: plans for a cluster this machine is not, priced by the estimate, none run.

A tiny Llama from its transformers config (defaults left on) is searched end to end on paper with the
real estimate; the walk's own rules (the pick, what is dropped and why) are checked with a stand-in
estimator whose figures are known, never to claim anything about pricing.
"""

import json
from types import SimpleNamespace

import pytest

from composable_atorch.auto import search
from composable_atorch.auto.onpaper import plan_on_paper, token_workload
from composable_atorch.auto.onpaper.price import OVER
from composable_atorch.auto.policy import Budget
from composable_atorch.auto.space import plan_key
from composable_atorch.cli import plan as cli_plan
from composable_atorch.core import strategy
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError
from composable_atorch.hardware import HardwareError
from zoo.configs import llama_config

SEQ, BATCH, WORLD = 32, 8, 4


def tiny_llama():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(llama_config(width=64))


def workload():
    return token_workload(tiny_llama, seq=SEQ, global_batch=BATCH)


def env(world=WORLD, nodes=1):
    return Environment(world_size=world, nodes=nodes, device="cuda", hardware="h100-sxm")


@pytest.fixture(scope="module")
def real():
    """One real search on paper (the estimate itself), a few plans priced."""
    return search(workload(), on_paper=True, env=env(), budget=Budget(n_trials=6, time_limit=300), progress=False)


def test_real_search_on_paper_ranks_fitting_plans_by_predicted_speed(real):
    assert real.priced and real.ranking, real.summary()
    best = real.best
    assert best.tokens_per_s_per_device == max(p.tokens_per_s_per_device for p in real.priced if p.fits)
    speeds = [p.tokens_per_s_per_device for p in real.ranking]
    assert speeds == sorted(speeds, reverse=True)
    for p in real.ranking:
        assert p.peak_bytes * (1 + real.margin) <= real.memory_limit
        # per device: the global batch's tokens over the world and the step
        assert p.tokens_per_s_per_device == pytest.approx(BATCH * SEQ / WORLD / p.step_time_s, rel=1e-6)
        assert 0 < p.mfu <= p.hfu < 1
    assert real.counts["priced: fits"] == len(real.ranking)
    assert sum(real.counts.values()) == real.space_size


def test_best_plan_round_trips_through_load_and_composes(real, tmp_path):
    path = real.write_best(tmp_path / "best_plan.json")
    loaded = strategy.load(path, env=env())  # compose() runs inside: the plan's rules checked again
    assert plan_key(loaded) == real.best.key
    # the file is the same plan JSON the estimate CLI and auto_accelerate(load_strategy=) read
    assert json.loads(open(path).read())["format"] == "composable_atorch.plan"


class StandIn:
    """A stand-in estimate with known figures: no checkpointing is over the limit, full checkpointing
    recomputes (slower), fp32 is slower than bf16. Only the walk's rules are tested with it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, plan, model_fn, batch, **kw):
        self.calls += 1
        names = plan.names
        checkpointed = "checkpoint" in names
        speed = 1000.0 * (1.5 if "amp" in names else 1.0) * (0.75 if checkpointed else 1.0)
        speed *= 1.0 + 0.01 * len(names)  # distinct speeds
        peak = (10 if checkpointed else 100) * 2**30
        step = BATCH * SEQ / WORLD / speed
        return SimpleNamespace(peak=peak, step_time_s=step, tokens_per_s_per_device=speed, tflops_per_device=1.0,
                               mfu=0.1, hfu=0.2, micro_batch=2, micro_batches=1)


def test_walk_picks_the_fastest_fitting_plan_and_says_why_others_dropped():
    fake = StandIn()
    result = plan_on_paper(workload(), env(), budget=Budget(n_trials=25, memory_limit="50GiB"), estimator=fake)
    over = [p for p in result.priced if p.status == OVER]
    assert over and all("checkpoint" not in p.plan.names for p in over)
    assert result.counts[f"priced: {OVER}"] == len(over)
    assert all(p.key not in {r.key for r in result.ranking} for p in over)
    fits = [p for p in result.priced if p.fits]
    assert result.best.tokens_per_s_per_device == max(p.tokens_per_s_per_device for p in fits)
    assert "checkpoint" in result.best.plan.names and "amp" in result.best.plan.names
    assert fake.calls == len(result.priced)  # each plan priced once
    text = "\n".join(result.summary())
    assert "over memory" in text and "not on the walk's path" in text


def test_walk_stops_at_the_plan_budget():
    result = plan_on_paper(workload(), env(), budget=Budget(n_trials=3), estimator=StandIn())
    assert len(result.priced) == 3 and result.ranking


def test_cli_json_has_the_fields_and_writes_the_best_plan(tmp_path, capsys):
    config = tmp_path / "config.json"
    llama_config(width=64).to_json_file(config)
    out = tmp_path / "best_plan.json"
    argv = ["--model", f"hf:{config}", "--gpu", "a100-80gb-sxm", "--world-size", "8", "--nodes", "1", "--seq",
            str(SEQ), "--global-batch", "16", "--max-plans", "3", "--json", "--out", str(out)]
    assert cli_plan.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == "a100-80gb-sxm" and data["world_size"] == 8 and data["best_plan"] == str(out)
    row = data["ranking"][0]
    for key in ("plan", "step_time_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "hfu", "peak_bytes",
                "fits"):
        assert key in row, key
    assert row["fits"] is True and data["dropped"]["priced: fits"] >= 1
    strategy.load(str(out), env=Environment(world_size=8, device="cuda", hardware="a100-80gb-sxm"))


BASE = ["--model", "llama3-8b", "--gpu", "h100-sxm", "--world-size", "64", "--nodes", "8", "--seq", "8192",
        "--global-batch", "512"]


def _with(**changes):
    argv = list(BASE)
    for flag, value in changes.items():
        flag = "--" + flag.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


@pytest.mark.parametrize(
    "changes, error, says",
    [
        ({"gpu": "h100-sxmm"}, HardwareError, "h100-sxm"),
        ({"nodes": "7"}, ConfigError, "divisor"),
        ({"global_batch": "100"}, ConfigError, "multiple of the world size 64"),
        ({"seq": "0"}, ConfigError, "--seq"),
        ({"model": "llama-9b"}, ConfigError, "llama3-8b"),
        ({"model": "hf:/nowhere/config.json"}, ConfigError, "config.json"),
        ({"margin": "1.5"}, ConfigError, "--margin"),
        ({"max_plans": "0"}, ConfigError, "--max-plans"),
    ],
)
def test_cli_bad_input_is_a_typed_error_before_any_work(changes, error, says, monkeypatch, capsys):
    import composable_atorch.auto as auto

    def no_work(*args, **kwargs):
        raise AssertionError("searched despite bad input")

    monkeypatch.setattr(auto, "search", no_work)
    with pytest.raises(error, match=says.replace(".", r"\.")):
        cli_plan.check(cli_plan.parse(_with(**changes)))
    assert cli_plan.main(_with(**changes)) == 2
    assert says in capsys.readouterr().err


def test_search_on_paper_needs_a_gpu_environment():
    with pytest.raises(ConfigError, match="world_size=64, nodes=8"):
        search(workload(), on_paper=True, env=Environment(world_size=4, device="cpu"))
    with pytest.raises(TypeError):
        search(workload(), on_paper=True, env=env(), trial=object())


def big_llama():
    """A 6.2B-parameter Llama (25 GB of fp32 weights: more than this machine can spare), as a user writes it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(llama_config(width=4096, layers=32, vocab=32000, intermediate_size=11008))


def test_a_model_too_large_for_this_machine_is_planned_for_tensor_parallelism_on_fake_tensors():
    """On paper the model is built on the meta device; tensor_parallel's planner (and ddp's unused-parameter
    probe) then trace a replica of fake tensors, not a zero-weight copy in this machine's memory: the
    7B's Megatron pairs are found in every layer, the plan is checked at degree 8, tensor degrees are
    offered by the search, and nothing near the model's size is allocated."""
    import resource

    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from composable_atorch.auto.workload import example_model
    from composable_atorch.transforms.parallel.shared import probe
    from composable_atorch.transforms.parallel.tensor import graph
    from composable_atorch.transforms.parallel.tensor.transform import TensorParallel

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    meta = example_model(big_llama)
    assert all(p.is_meta for p in meta.parameters())
    assert all(isinstance(p, FakeTensor) for p in probe.replica(meta).parameters())
    pairs = graph.pairs(meta, graph.trace(meta, graph.example_input(meta)))
    attn = [p for p in pairs if p.row.endswith("self_attn.o_proj")]
    mlp = [p for p in pairs if p.row.endswith("mlp.down_proj")]
    assert len(attn) == len(mlp) == 32 and len(pairs) == 64
    assert {c.rsplit(".", 1)[1] for p in attn for c in p.cols} == {"q_proj", "k_proj", "v_proj"}
    notes = TensorParallel().check(meta, 8)  # one rank's shapes run on an example input, on fake tensors
    assert any("plan verified at tensor degree 8" in n for n in notes), notes
    assert probe.probe_unused(meta).unused == []
    result = plan_on_paper(
        token_workload(big_llama, seq=SEQ, global_batch=BATCH), env(world=8), budget=Budget(n_trials=2),
        estimator=StandIn(),
    )
    assert "tensor:" in result.axes
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    weights = sum(p.numel() * p.element_size() for p in meta.parameters())
    assert weights > 24e9 and grew < 2e9, (weights, grew)
    assert torch.get_default_device() == torch.device("cpu")


def test_on_paper_candidates_widen_only_on_paper():
    """Priced, not run: accumulate offers every power-of-two micro-batch count, fp8 both torchao recipes,
    tensor_parallel ``tensor x data`` layouts up to a node, mixed_parallel each schedule; a trial search's
    candidates are unchanged (its space is pinned in test_space_pinned)."""
    from composable_atorch.core.context import LayoutOption, NotOffered, SearchContext
    from composable_atorch.transforms.fp8 import Fp8
    from composable_atorch.transforms.loop import Accumulate
    from composable_atorch.transforms.parallel.mixed import MixedParallel
    from composable_atorch.transforms.parallel.tensor.transform import TensorParallel

    cluster = Environment(world_size=16, nodes=2, device="cuda", hardware="h100-sxm", packages={"torchao"})
    paper = SearchContext(env=cluster, batch_size=256, on_paper=True)
    trial = SearchContext(env=cluster, batch_size=256)
    assert [c.steps for c in Accumulate.candidates(paper)] == [2, 4, 8, 16]
    assert [c.steps for c in Accumulate.candidates(trial)] == [2, 4]
    assert sorted(c.recipe for c in Fp8.candidates(paper)) == ["rowwise", "tensorwise"]
    assert len(Fp8.candidates(trial)) == 1
    assert TensorParallel.candidates(trial) == ()
    offered = TensorParallel.candidates(paper)
    assert sorted(o.degree for o in offered if isinstance(o, LayoutOption)) == [2, 4, 8]
    assert any(isinstance(o, NotOffered) for o in offered)  # 16: over the 8 devices of a node
    pipelines = MixedParallel.candidates(paper)
    assert len({c.schedule for c in pipelines}) > 1 and all(c.pipeline > 1 for c in pipelines)
    assert all((c.tensor or 1) <= 8 for c in pipelines)

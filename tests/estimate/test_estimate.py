"""composable_atorch.estimate: predicted peak per rank vs the trial's own measurement, and bad input.

Measured here the way the trial worker measures (``auto.worker.peak_bytes_of_step``, torch
MemTracker over one step after two warm-up steps), with the step's batch made before the tracker
starts; predicted with nothing real allocated (meta model, fake tensors, fake process group).
Bound (issue 12): within 10 % per plan.
"""

from __future__ import annotations

import pytest
import torch

import composable_atorch as ca
import composable_atorch.estimate as estimate_pkg
from composable_atorch.auto.workload import GPTTask
from composable_atorch.errors import ConfigError
from composable_atorch.estimate import EstimateError, estimate
from composable_atorch.models import Block

TASK = GPTTask(seq_len=64, d_model=64, n_layer=2, n_head=4, batch_size=8)
BOUND = 0.10


def measure(plan_json: str, world: int, criterion=None, parts: bool = False):
    """The trial's peak of one step of ``plan_json`` in this process (a group of ``world`` exists);
    ``criterion``: train as the worker does for a workload with one (pipeline plans need it).
    ``parts``: also this rank's pipeline stage(s) and parameter bytes."""
    from composable_atorch.auto.worker import peak_bytes_of_step, prefetch, trial_step
    from composable_atorch.runtime.train_step import runner_of

    torch.manual_seed(0)
    model = TASK.model()
    optim = TASK.optimizer(model)
    loader = torch.utils.data.DataLoader(range(TASK.batch_size), batch_size=TASK.batch_size)
    model, optim, loader = ca.Plan.from_json(plan_json)(model, optim, loader)
    micro = loader.batch_size
    tokens = torch.randint(0, 256, (micro, TASK.seq_len))
    data = iter([(tokens, tokens.clone())] * (3 * int(getattr(optim, "accumulation_steps", 1))))
    for _ in range(2):
        trial_step(model, optim, data, TASK.loss, "cpu", criterion=criterion)
    fetched = prefetch(optim, data, "cpu")  # as the worker does: the batch is fetched before the tracker
    peak, _ = peak_bytes_of_step(
        lambda before_micro=None: trial_step(
            model, optim, iter(fetched), TASK.loss, "cpu", before_micro, criterion=criterion
        ),
        model,
        optim,
        "cpu",
    )
    if not parts:
        return peak
    runner = runner_of(optim)
    return {
        "peak": peak,
        "stages": None if runner is None else list(runner.local),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def predict(plan_json: str, world: int) -> int:
    shape = torch.Size([TASK.batch_size, TASK.seq_len])
    return estimate(
        plan_json,
        TASK.model,
        (shape, shape),
        world_size=world,
        device="cpu",
        loss_fn=TASK.loss,
        optimizer=TASK.optimizer,
    ).peak


def _measure_many(rank, world, plans):
    return [measure(p, world) for p in plans]


def test_world_1_plans_within_bound():
    env = ca.Environment.detect().with_(world_size=1)
    for plan in (
        ca.compose(env=env),
        ca.compose(ca.checkpoint(Block), ca.amp("bf16"), env=env),
        ca.compose(ca.checkpoint(Block, policy="selective"), ca.amp("bf16"), env=env),
        ca.compose(ca.accumulate(2), env=env),
        # half casts the module: on fake tensors torch's Module.to swapped and failed, it is cast in place now
        ca.compose(ca.half("bf16"), env=env),
        ca.compose(ca.half("bf16", master_weights=False), ca.checkpoint(Block), env=env),
    ):
        text = plan.to_json()
        measured, predicted = measure(text, 1), predict(text, 1)
        assert abs(predicted - measured) / measured <= BOUND, (plan.names, predicted, measured)


def test_selective_checkpoint_keeps_less_than_none_more_than_full_and_reruns_no_matmul():
    """Measured and predicted: the peak orders none > selective > full; the estimate's traced step
    reruns every forward matmul under full checkpointing and none under selective (all saved)."""
    env = ca.Environment.detect().with_(world_size=1)
    shape = torch.Size([TASK.batch_size, TASK.seq_len])
    kw = dict(world_size=1, device="cpu", loss_fn=TASK.loss, optimizer=TASK.optimizer)
    runs = {}
    for label, steps in (
        ("none", ()),
        ("full", (ca.checkpoint(Block),)),
        ("selective", (ca.checkpoint(Block, policy="selective"),)),
    ):
        text = ca.compose(*steps, env=env).to_json()
        runs[label] = (measure(text, 1), estimate(text, TASK.model, (shape, shape), **kw))
    measured = {k: m for k, (m, _) in runs.items()}
    predicted = {k: e.peak for k, (_, e) in runs.items()}
    assert measured["none"] > measured["selective"] > measured["full"], measured
    assert predicted["none"] > predicted["selective"] > predicted["full"], predicted
    for k in runs:
        assert abs(predicted[k] - measured[k]) / measured[k] <= BOUND, (k, predicted[k], measured[k])
    flops = {k: e.flops for k, (_, e) in runs.items()}
    assert flops["selective"] == flops["none"] < flops["full"], flops


@pytest.mark.dist
def test_world_2_plans_within_bound():
    from _dist import run_world

    env = ca.Environment.detect().with_(world_size=2)
    plans = [
        ca.compose(p, env=env).to_json()
        for p in (
            ca.fsdp(wrap=Block),
            ca.fsdp(wrap=Block) | ca.checkpoint(Block, policy="selective"),
            ca.zero2() | ca.checkpoint(Block),
            ca.ddp() | ca.amp("bf16"),
            ca.ddp() | ca.zero1(),
            # the peak is in the backward, where DDP's buckets count (they were 12-17 % under before)
            ca.checkpoint(Block) | ca.ddp(),
            ca.checkpoint(Block) | ca.ddp() | ca.zero1(),
        )
    ]
    measured = run_world(_measure_many, 2, plans)
    for i, text in enumerate(plans):
        peak = max(m[i] for m in measured)
        predicted = predict(text, 2)
        assert abs(predicted - peak) / peak <= BOUND, (text, predicted, peak)


def test_ddp_buckets_follow_torch_caps_and_count_on_cuda_all_step():
    from composable_atorch.estimate.simulate import BUCKET_CAPS, bucket_sizes

    params = [torch.empty(2**18) for _ in range(4)] + [torch.empty(2**16)]  # 4 x 1 MiB + 256 KiB fp32
    buckets = bucket_sizes(params, 1.0)
    assert buckets[0] == (4, 2**18 + 2**20)  # the last-registered parameter is ready first; first cap 1 MiB
    assert sum(n for _, n in buckets) == sum(p.numel() * 4 for p in params) and BUCKET_CAPS[1] == 25 * 2**20
    shape = torch.Size([TASK.batch_size, TASK.seq_len])
    env = ca.Environment.detect().with_(world_size=2)
    plan = ca.compose(ca.ddp(), env=env)
    kw = dict(world_size=2, loss_fn=TASK.loss, optimizer=TASK.optimizer)
    cpu, cuda = (
        estimate(plan, TASK.model, (shape, shape), device="cpu", **kw),
        estimate(plan, TASK.model, (shape, shape), device="cuda", **kw),
    )
    buckets = cuda.extra["ddp_bucket_bytes"]
    assert buckets == sum(p.numel() * 4 for p in TASK.model().parameters())
    assert cuda.peak == cuda.extra["memtracker"]["Total"] + buckets  # on CUDA: held the whole step
    assert cpu.peak == cpu.extra["memtracker"]["Total"]  # on the CPU: inside the simulated step, from the backward on


def _half_frozen():
    model = TASK.model()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))  # frozen base weights, as LoRA leaves them
    return model


def test_frozen_parameters_are_estimated_under_fsdp():
    # torch's MemTracker hooks every parameter a module's forward touches and raised on frozen ones
    shape = torch.Size([TASK.batch_size, TASK.seq_len])
    kw = dict(
        world_size=2,
        device="cpu",
        loss_fn=TASK.loss,
        optimizer=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]),
    )
    frozen = estimate(ca.fsdp(wrap=Block), _half_frozen, (shape, shape), **kw)
    full = estimate(ca.fsdp(wrap=Block), TASK.model, (shape, shape), **kw)
    assert 0 < frozen.ranks[0].optimizer < full.ranks[0].optimizer


def test_result_interface():
    shape = torch.Size([TASK.batch_size, TASK.seq_len])
    est = estimate_pkg.estimate(
        ca.fsdp(wrap=Block), TASK.model, (shape, shape), world_size=4, device="cpu", loss_fn=TASK.loss
    )
    assert len(est.ranks) == 4 and est.peak == max(r.peak for r in est.ranks)
    r = est.ranks[0]
    assert r.parameters > 0 and r.optimizer > 0 and r.activations > 0
    assert est.fits(est.peak * 2) and not est.fits(est.peak) and est.fits(est.peak, margin=0.0)
    assert "peak" in est.table() and est.to_dict()["peak"] == est.peak
    # on the CPU: the simulated step's ops priced with this machine's calibration (estimate.steptime)
    assert est.step_time_s > 0 and est.step_time_mode == estimate_pkg.core.MODELLED
    # sharding divides the states: world 4 holds less than world 1
    one = estimate(ca.compose(), TASK.model, (shape, shape), world_size=1, device="cpu", loss_fn=TASK.loss)
    assert r.parameters < one.ranks[0].parameters


def test_bad_input_is_typed_and_names_the_fix():
    shape = torch.Size([8, 64])

    def needs_values():
        m = TASK.model()
        float(m.head.weight.sum())  # reads values: cannot run on meta
        return m

    with pytest.raises(EstimateError, match="meta device"):
        estimate(ca.compose(), needs_values, (shape, shape), world_size=1, device="cpu")
    with pytest.raises(ConfigError, match="batch"):
        estimate(ca.compose(), TASK.model, {"a": 3}, world_size=1, device="cpu")
    with pytest.raises(ConfigError, match="world_size"):
        estimate(ca.compose(), TASK.model, (shape, shape), world_size=0, device="cpu")
    with pytest.raises(ConfigError, match="world_size"):
        tp2 = ca.compose(ca.mixed_parallel(tensor=2), env=ca.Environment.detect().with_(world_size=2))
        estimate(tp2, TASK.model, (shape, shape), world_size=3, device="cpu")


def test_trial_measurement_of_a_model_with_frozen_weights():
    # the trial worker measures with the estimate's tracker: plain MemTracker raised on LoRA-style frozen weights
    from composable_atorch.auto.worker import peak_bytes_of_step

    model = _half_frozen()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    x = torch.randint(0, 64, (TASK.batch_size, TASK.seq_len))

    def step(before_micro=None):
        if before_micro is not None:
            before_micro()
        TASK.loss(model, (x, x)).backward()
        optim.step()
        optim.zero_grad()

    peak, how = peak_bytes_of_step(step, model, optim, "cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak > weights and "MemTracker" in how


# --- pipeline plans: one simulated rank per stage -------------------------------------------------


def _criterion(output, targets):
    from composable_atorch.models.gpt import lm_loss

    return lm_loss(output, targets)


def _estimate_pp(plan, world: int, task=TASK, **kw):
    shape = torch.Size([task.batch_size, task.seq_len])
    return estimate(plan, task.model, (shape, shape), world_size=world, device="cpu", optimizer=task.optimizer, **kw)


def _measure_parts(rank, world, plans):
    return [measure(p, world, criterion=_criterion, parts=True) for p in plans]


def test_pipeline_plan_without_a_criterion_is_a_typed_error_naming_the_fix():
    env = ca.Environment.detect().with_(world_size=2)
    plan = ca.compose(ca.mixed_parallel(pipeline=2), env=env)
    with pytest.raises(ConfigError, match="criterion"):
        _estimate_pp(plan, 2, loss_fn=TASK.loss)
    with pytest.raises(ConfigError, match="criterion"):
        _estimate_pp(plan, 2, criterion="lm_loss")
    # several stages on one rank (interleaved): refused with the fix, not guessed
    four = GPTTask(seq_len=32, d_model=32, n_layer=4, n_head=4, batch_size=8)
    interleaved = ca.compose(ca.mixed_parallel(pipeline=2, microbatches=4, schedule="Interleaved1F1B"), env=env)
    with pytest.raises(EstimateError, match="1F1B"):
        _estimate_pp(interleaved, 2, task=four, criterion=_criterion)


def test_tensor_x_pipeline_ranks_get_their_stage_cost():
    env = ca.Environment.detect().with_(world_size=4)
    est = _estimate_pp(ca.compose(ca.mixed_parallel(tensor=2, pipeline=2), env=env), 4, criterion=_criterion)
    # the layout's first dim varies fastest: ranks 0,1 are the tensor pair of stage 0, ranks 2,3 of stage 1
    assert [r.stage for r in est.ranks] == [0, 0, 1, 1]
    assert est.ranks[0] == est.ranks[1] and est.ranks[2] == est.ranks[3] and est.ranks[0] != est.ranks[2]
    assert est.peak == max(est.ranks[0].peak, est.ranks[2].peak) and "(stage 1)" in est.table()
    assert len(est.extra["memtracker_by_stage"]) == 2


@pytest.mark.dist
def test_pipeline_stages_within_bound_of_a_gloo_run_at_world_2():
    from _dist import run_world

    env = ca.Environment.detect().with_(world_size=2)
    plans = [
        ca.compose(*steps, env=env).to_json()
        for steps in (  # `|` would compose for this process's world of 1
            (ca.mixed_parallel(pipeline=2, microbatches=2),),
            (ca.mixed_parallel(pipeline=2, microbatches=4), ca.checkpoint(Block)),
            (ca.mixed_parallel(pipeline=2, microbatches=2), ca.amp("bf16")),
            (ca.mixed_parallel(tensor=2),),
        )
    ]
    measured = run_world(_measure_parts, 2, plans)
    for i, text in enumerate(plans):
        est = _estimate_pp(text, 2, loss_fn=TASK.loss, criterion=_criterion)
        for rank in range(2):
            got, want = measured[rank][i], est.ranks[rank]
            assert abs(want.peak - got["peak"]) / got["peak"] <= BOUND, (text, rank, want.peak, got["peak"])
            if got["stages"] is None:  # tensor parallel: no stages, equal ranks
                assert want.stage is None
                continue
            assert [want.stage] == got["stages"]  # the estimate's stage map is the one the run built
            assert want.parameters == got["param_bytes"]  # each stage's own parameters, exactly
        if got["stages"] is not None:  # the stages differ: the first holds the embeddings, the last the head
            assert est.ranks[0].parameters != est.ranks[1].parameters and est.ranks[0].peak != est.ranks[1].peak


def test_cli_prints_each_stage_of_a_pipeline_plan_and_whether_it_fits(tmp_path, capsys):
    """``python -m composable_atorch estimate``: a pipeline plan gets a row per stage (the CLI trains
    it on (tokens, targets) with next-token cross-entropy inside the schedule); a budget below
    the peak exits 1 and says so; a corrupt plan file is an error line and exit 2."""
    from composable_atorch.cli.estimate import main
    from composable_atorch.environment import Environment

    path = tmp_path / "pp.json"
    path.write_text(ca.compose(ca.mixed_parallel(pipeline=2), env=Environment.detect().with_(world_size=2)).to_json())
    assert (
        main([str(path), "--model", "gpt", "--batch", "2", "--seq", "32", "--world-size", "2", "--device", "cpu"]) == 0
    )
    out = capsys.readouterr().out
    assert "0 (stage 0)" in out and "1 (stage 1)" in out
    assert (
        main(
            [
                str(path),
                "--model",
                "gpt",
                "--batch",
                "2",
                "--seq",
                "32",
                "--world-size",
                "2",
                "--device",
                "cpu",
                "--device-memory",
                "1KiB",
            ]
        )
        == 1
    )
    assert "does NOT fit in 1KiB" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad), "--world-size", "2", "--device", "cpu"]) == 2
    assert capsys.readouterr().out.startswith("error:")


def test_steps_2_counts_what_one_step_keeps_alive_into_the_next():
    """A loop that keeps its last outputs (here: logs the last two steps' logits) holds one step's
    tensors through the next step. Measured over two steps, the estimate sees them (one step cannot:
    they were made before its tracker started); the difference is the kept logits, to the byte."""
    from collections import deque

    shape = torch.Size([TASK.batch_size, TASK.seq_len])

    class KeepsLastTwo:
        def __init__(self):
            self.kept = deque(maxlen=2)

        def __call__(self, model, batch):
            logits = model(batch[0])
            self.kept.append(logits.detach())
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))

    def peak(steps):
        return estimate(
            ca.compose(),
            TASK.model,
            (shape, shape),
            world_size=1,
            device="cpu",
            loss_fn=KeepsLastTwo(),
            optimizer=TASK.optimizer,
            steps=steps,
        ).peak

    logits_bytes = TASK.batch_size * TASK.seq_len * TASK.model().head.out_features * 4
    assert peak(2) - peak(1) == logits_bytes
    with pytest.raises(ConfigError, match="steps"):
        estimate(ca.compose(), TASK.model, (shape, shape), world_size=1, device="cpu", steps=0)

"""Pre-flight and the search's policy signature: a user error stops the search before any trial."""

import time

import pytest
import torch
from torch.utils.data import Dataset

import composable_atorch as ca
from composable_atorch.auto.policy import LEGACY_KEYWORDS, Budget, SpaceOptions, StudyOptions, TrialSettings
from composable_atorch.auto.preflight import loss_hint, preflight
from composable_atorch.auto.study import search
from composable_atorch.auto.trial import TrialResult, samples_per_step
from composable_atorch.auto.worker import sample_ids
from composable_atorch.auto.workload import Workload
from composable_atorch.data import TextDataset
from composable_atorch.errors import CompositionError, ConfigError, WorkloadError
from composable_atorch.models import GPT

from auto_faults import adamw, lm_step

#: wall-clock budgets and timeouts (hangs, heartbeats, rendezvous, kills mid-step): run one file at a time,
#: at a CPU priority above every other file's (tests/run.sh, the README's test command)
pytestmark = pytest.mark.serial


class DictData(Dataset):
    """Batches are dicts, as a HuggingFace-style dataset gives them."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        x = torch.arange(i, i + 16) % 64
        return {"tokens": x, "targets": x}


class KwargGPT(GPT):
    def forward(self, tokens, targets=None):  # noqa: D102 - takes the dict's keys as keywords
        return super().forward(tokens)


def whole_batch_loss(model, batch):  # the facade's model_input_format=None: model(batch)
    return torch.nn.functional.cross_entropy(model(batch).flatten(0, 1), batch["targets"].flatten())


def small_gpt():
    return KwargGPT(ca.models.GPTConfig(seq_len=16, d_model=16, n_layer=1, n_head=2))


def not_a_loss(model, batch):
    return 1.0


class NeverRun:
    def __init__(self):
        self.calls = 0

    def __call__(self, plan, *, timeout):
        self.calls += 1
        return TrialResult(status="failed", reason="should not run")


def test_a_dict_batch_the_model_cannot_take_stops_the_search_at_once_with_the_hint():
    runner = NeverRun()
    start = time.monotonic()
    with pytest.raises(WorkloadError, match="model_input_format='unpack_dict'") as info:
        search(
            Workload(small_gpt, adamw, DictData(), whole_batch_loss, 8),
            trial=TrialSettings(world_size=2),
            budget=Budget(time_limit=300),
            runner=runner,
            progress=False,
        )
    assert runner.calls == 0 and time.monotonic() - start < 30  # not after time_limit
    assert isinstance(info.value, CompositionError) and info.value.part == "loss_fn(model, batch)"
    assert "TypeError" in info.value.error or "AttributeError" in info.value.error


def test_preflight_names_the_part_that_failed():
    with pytest.raises(WorkloadError, match="scalar loss") as info:
        preflight(Workload(small_gpt, adamw, TextDataset(16, limit=32), not_a_loss, 8))
    assert info.value.part == "loss_fn(model, batch)"
    with pytest.raises(WorkloadError, match="at least batch_size=64"):
        preflight(Workload(small_gpt, adamw, TextDataset(16, limit=32), lm_step, 64))
    ok = preflight(Workload(small_gpt, adamw, TextDataset(16, limit=32), lm_step, 8))
    assert ok.ok and ok.note is None


def test_loss_hint_names_the_argument_for_each_batch_shape():
    assert "unpack_dict" in loss_hint({"a": 1}, TypeError("x"))
    assert "unpack_sequence" in loss_hint((1, 2), TypeError("x"))
    assert "unpack" not in loss_hint(torch.zeros(2), RuntimeError("x"))


def test_preflight_can_be_turned_off_and_then_trials_see_the_error():
    runner = NeverRun()
    result = search(
        Workload(small_gpt, adamw, DictData(), whole_batch_loss, 8),
        trial=TrialSettings(world_size=2),
        budget=Budget(n_trials=1),
        space=SpaceOptions(excluded=tuple(ca.registry())),
        study=StudyOptions(preflight=False),
        runner=runner,
        progress=False,
    )
    assert runner.calls == 1 and result.preflight is None and result.best is None


class Recorder:
    def __init__(self):
        self.timeouts = []

    def __call__(self, plan, *, timeout):
        self.timeouts.append(timeout)
        return TrialResult(status="ok", samples_per_s=10.0, peak_bytes=2**20)


def test_the_0x_keywords_and_the_policies_give_the_same_search():
    kept = ("amp", "checkpoint")
    others = tuple(sorted(set(ca.registry()) - set(kept)))
    old_runner, new_runner = Recorder(), Recorder()
    old = search(
        GPT,
        adamw,
        TextDataset(16, limit=64),
        lm_step,
        world_size=2,
        batch_size=16,
        excluded=others,
        n_trials=3,
        seed=1,
        trial_timeout=77,
        runner=old_runner,
        progress=False,
        predict=False,
    )
    new = search(
        Workload(GPT, adamw, TextDataset(16, limit=64), lm_step, 16, seed=1),
        trial=TrialSettings(world_size=2, timeout=77),
        budget=Budget(n_trials=3),
        space=SpaceOptions(excluded=others),
        study=StudyOptions(seed=1, predict=False),
        runner=new_runner,
        progress=False,
    )
    assert [r.assignment for r in old.measured] == [r.assignment for r in new.measured]
    assert old_runner.timeouts == new_runner.timeouts == [77, 77, 77]
    assert old.preflight.ok and new.preflight.ok
    assert set(LEGACY_KEYWORDS) >= {"world_size", "batch_size", "n_trials", "memory_limit", "customize", "storage"}
    with pytest.raises(TypeError, match="unexpected keyword"):
        search(GPT, adamw, TextDataset(16, limit=64), lm_step, world_size=2, batch_size=16, n_trails=3)
    with pytest.raises(TypeError, match="policy keywords"):
        search(Workload(GPT, adamw, TextDataset(16, limit=64), lm_step, 16), n_trials=3)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Budget(n_trials=0), "n_trials"),
        (lambda: Budget(time_limit=-1), "time_limit"),
        (lambda: Budget(memory_limit="lots"), "memory_limit"),
        (lambda: SpaceOptions(excluded="amp"), "excluded"),
        (lambda: StudyOptions(n_startup_trials=-1), "n_startup_trials"),
    ],
)
def test_policies_check_their_fields_when_made(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_throughput_counts_each_sample_once_across_ranks():
    a, b = ["s1", "s2", "s3", "s4"], ["s5", "s6", "s7", "s8"]
    # two ranks on disjoint halves (data parallel): the global batch of 8 per step
    assert samples_per_step([{"sample_ids": [a, a]}, {"sample_ids": [b, b]}], 8) == 4 * 2
    # two ranks repeating the same samples (no data parallelism, or tensor-parallel peers): counted once
    assert samples_per_step([{"sample_ids": [a + b]}, {"sample_ids": [a + b]}], 8) == 8
    assert samples_per_step([{"sample_ids": [a]}, {"sample_ids": [a]}], 16) == 4  # not the configured global batch
    # a sample that comes back in a later step (the epoch wrapped) counts again there
    assert samples_per_step([{"sample_ids": [a, a]}], 4) == 4
    assert samples_per_step([{"sample_ids": None}, {"sample_ids": [a]}], 16) == 16  # no digests: the global batch


def test_sample_ids_tell_samples_apart_by_every_tensor_of_the_batch():
    x = torch.tensor([[1, 2], [1, 2], [3, 4]])
    y = torch.tensor([0, 1, 0])
    ids = sample_ids((x, y))
    assert len(ids) == 3 and ids[0] != ids[1] and len(set(ids)) == 3
    assert sample_ids({"t": x.bfloat16()}) == sample_ids({"t": x.bfloat16()})
    assert sample_ids([1, 2]) is None


@pytest.mark.dist  # the facade's search runs the preflight in a child process
def test_auto_accelerate_stops_at_once_when_the_model_cannot_take_the_dict_batch():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import seed_task

    start = time.monotonic()
    with pytest.raises(WorkloadError, match="model_input_format='unpack_dict'"):  # model_input_format not set
        ca.auto_accelerate(
            seed_task.build(),
            optim_func=torch.optim.AdamW,
            dataset=seed_task.DictText(),
            loss_func=seed_task.loss_func,
            dataloader_args={"batch_size": 8},
            time_limit=600,
        )
    assert time.monotonic() - start < 60  # at once, not after time_limit


def test_the_baseline_runs_first_even_where_compose_implies_data_parallelism():
    kept = ("amp", "checkpoint", "ddp", "zero1", "zero2", "fsdp")
    others = tuple(sorted(set(ca.registry()) - set(kept)))
    runner = Recorder()
    result = search(
        Workload(GPT, adamw, TextDataset(16, limit=64), lm_step, 16),
        trial=TrialSettings(world_size=2),
        budget=Budget(n_trials=2),
        space=SpaceOptions(excluded=others),
        study=StudyOptions(seed=0, predict=False),
        runner=runner,
        progress=False,
    )
    first = result.measured[0]
    baseline = ca.compose(env=result.space.env)
    assert first.steps == baseline.names and "ddp" in first.steps  # the plan of no request, data parallel at world 2

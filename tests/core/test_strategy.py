"""Strategies as data: the seed's list form, JSON text, files, never pickle."""

import json
import pickle

import pytest
import torch

import composable_atorch as ca
from composable_atorch import strategy
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, UnknownTransformError
from composable_atorch.models import Block

CPU = Environment()


def test_seed_list_form_maps_names_and_configs():
    plan = strategy.load(
        [("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", (Block,)), ("half", "bf16")], env=CPU
    )
    assert plan == ca.compose(ca.amp("bf16"), ca.checkpoint(Block), ca.half("bf16"), env=CPU)


def test_seed_defaults():
    assert strategy.load(["amp_native"], env=CPU).transforms == (ca.amp("fp16"),)
    assert strategy.load(["half"], env=CPU).transforms == (ca.half("fp16"),)
    assert strategy.load(
        [("amp_native", {"dtype": torch.bfloat16, "skip_if_nonfinite": True})], env=CPU
    ).transforms == (ca.amp("bf16", skip_if_nonfinite=True),)
    assert strategy.load([("checkpoint", {"wrap_class": (Block,), "no_reentrant": False})], env=CPU).transforms == (
        ca.checkpoint(Block, reentrant=True),
    )


def test_dump_and_load_file_roundtrip_with_classes_as_import_paths(tmp_path):
    plan = ca.compose(ca.checkpoint(Block), ca.amp("bf16"), ca.accumulate(2), env=CPU)
    path = tmp_path / "plan.json"
    text = strategy.dump(plan, path)
    data = json.loads(path.read_text())
    assert data["transforms"][0]["config"]["targets"] == [{"$class": "composable_atorch.models.gpt:Block"}]
    assert strategy.load(path, env=CPU) == plan
    assert strategy.load(str(path), env=CPU) == plan
    assert strategy.load(text, env=CPU) == plan
    assert strategy.load(text.encode(), env=CPU) == plan
    assert strategy.load(plan) is plan


def test_seed_list_as_json_text():
    text = json.dumps([["amp_native", {"dtype": {"$dtype": "bfloat16"}}], "half"])
    with pytest.raises(Exception) as err:  # fp16 half + bf16 amp conflict, proving both parsed
        strategy.load(text, env=CPU)
    assert "conflicts" in str(err.value)
    text = json.dumps([["amp_native", {"dtype": {"$dtype": "bfloat16"}}], ["half", "bf16"]])
    assert strategy.load(text, env=CPU).names == ("half", "amp")


def test_pickle_is_refused_never_unpickled(tmp_path):
    evil = pickle.dumps(["amp_native"])
    with pytest.raises(ConfigError, match="pickle is refused"):
        strategy.load(evil, env=CPU)
    path = tmp_path / "strategy.pkl"
    path.write_bytes(evil)
    with pytest.raises(ConfigError, match="pickle is refused"):
        strategy.load(path, env=CPU)
    proto0 = pickle.dumps(["amp_native"], protocol=0)
    with pytest.raises(ConfigError, match="pickle is refused"):
        strategy.load(proto0, env=CPU)


def test_corrupt_and_unknown_inputs_are_typed_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "composable_atorch.plan", "version": 1, "transforms": [{"name": 3}]}')
    with pytest.raises(ConfigError, match="transforms\\[0\\]"):
        strategy.load(bad, env=CPU)
    truncated = tmp_path / "trunc.json"
    truncated.write_text(ca.compose(ca.amp("bf16"), env=CPU).to_json()[:40])
    with pytest.raises(ConfigError, match="valid JSON"):
        strategy.load(truncated, env=CPU)
    with pytest.raises(ConfigError, match="existing .json file"):
        strategy.load(tmp_path / "missing.json", env=CPU)
    with pytest.raises(ConfigError, match="name or a \\(name, config\\) pair"):
        strategy.load([("amp_native", {}, "extra")], env=CPU)
    with pytest.raises(UnknownTransformError, match="did you mean 'amp_native'"):
        strategy.load(["amp_natve"], env=CPU)
    with pytest.raises(ConfigError, match="class path"):
        strategy.load(json.dumps([["checkpoint", [{"$class": "no.such.module:Block"}]]]), env=CPU)
    with pytest.raises(ConfigError):
        strategy.load(12, env=CPU)


def test_every_seed_model_parallel_name_is_built():
    # these once said "not built yet"; each now resolves to a transform of its own
    from composable_atorch.core.transform import lookup

    for name in ("tensor_parallel", "pipeline_parallel", "mixed_parallel", "ds_3d_parallel", "deepspeed_3d_parallel"):
        assert lookup(name).name in (name, "ds_3d_parallel"), name
    with pytest.raises(UnknownTransformError):
        strategy.load(["ds_4d_parallel"], env=CPU)


def test_local_classes_cannot_be_saved():
    class Local(torch.nn.Module):
        pass

    plan = ca.compose(ca.checkpoint(Local), env=CPU)
    with pytest.raises(ConfigError, match="module-level class"):
        plan.to_json()

"""The hardware catalog as data, and hostile declarations refused before any work (issue 37, item 1)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, UntrustedInputError
from composable_atorch.hardware import CATALOG, Hardware, HardwareError, from_dict, get, load, names, resolve

REQUIRED = {"a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "mi300x"}


def test_catalog_names_the_devices_the_issue_asks_for():
    assert REQUIRED <= set(names())


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_figure_is_positive_finite_and_sourced(name):
    hw = get(name)
    for figure, value in hw.figures().items():
        assert math.isfinite(value) and value >= 0, (figure, value)
        assert figure == "launch_s" or value > 0, figure
        source = hw.source(figure)
        assert source and source != "declared", f"{name}: {figure} has no source"
    for group in ("gemm", "attention"):
        for key, curve in getattr(hw, group).items():
            assert curve.source and all(0 < f <= 1.5 for _, f in curve.points), (group, key)
            assert hw.source(f"{group}.{key}") != "declared"
    for link in (hw.intra, hw.network):
        assert link.source
        assert all(c.source and 0 < c(1e6) <= 1.5 for c in link.collectives.values())
    assert hw.memory.source and hw.source("memory") != "declared"
    assert hw.peak("bfloat16") >= hw.peak("float32")  # tensor cores beat CUDA cores on every card


def test_datasheet_figures_are_the_dense_ones():
    assert get("h100-sxm").peak("bfloat16") == pytest.approx(989.4e12)
    assert get("h100-sxm").peak("float8") == pytest.approx(2 * 989.4e12, rel=1e-3)
    assert get("a100").peak("bfloat16") == 312e12
    assert get("a100").peak("float8") == 312e12  # no fp8 units on Ampere: the bf16 rate
    assert get("h100-sxm").intra.bandwidth == 450e9  # NVLink 4: 900 GB/s both ways


def test_hardware_is_hashable_and_an_environment_holds_it():
    env = Environment(world_size=8, device="cuda", hardware="h100-sxm")
    assert env.hardware is get("h100-sxm") and env.compute_capability == (9, 0)
    assert hash(env) == hash(Environment(world_size=8, device="cuda", hardware="h100-sxm"))
    assert Environment(device="cuda", hardware="mi300x").compute_capability == (9, 4)
    assert "h100-sxm" in env.describe()


def test_unknown_name_suggests_the_nearest():
    with pytest.raises(HardwareError, match="did you mean 'h100-sxm'"):
        get("h100-sx")
    with pytest.raises(HardwareError):
        Environment(device="cuda", hardware="a1000")


@pytest.mark.parametrize(
    "change",
    [
        {"memory_bandwidth": -1.0},
        {"memory_bandwidth": float("nan")},
        {"memory_bytes": float("inf")},
        {"launch_s": -1e-6},
        {"memory_bandwidth": "3.35e12"},
        {"memory_bandwidth": True},
        {"peak_flops": {"bfloat16": 0.0}},
        {"peak_flops": {"float64": 1e12, "bfloat16": 1e12}},
        {"devices_per_node": 0},
        {"compute_capability": (9,)},
    ],
)
def test_bad_figures_are_typed_errors(change):
    base = get("h100-sxm")
    with pytest.raises(HardwareError):
        base.replace(**change)
    data = {"base": "h100-sxm", **{k: (list(v) if isinstance(v, tuple) else v) for k, v in change.items()}}
    with pytest.raises(HardwareError):
        from_dict(data)


def test_hardware_error_is_a_config_error():
    assert issubclass(HardwareError, ConfigError)


def test_declaration_with_a_base_overrides_what_it_gives(tmp_path):
    hw = from_dict({"name": "ours", "base": "h100-sxm", "network": {"bandwidth": 25e9, "source": "200 Gb/s per GPU"}})
    assert hw.network.bandwidth == 25e9 and hw.network.source == "200 Gb/s per GPU"
    assert hw.intra == get("h100-sxm").intra and hw.name == "ours"
    path = tmp_path / "ours.toml"
    path.write_text('name = "ours"\nbase = "a100"\nmemory_bytes = "40GiB"\n[peak_flops]\nbfloat16 = 3.0e14\n')
    read = load(path)
    assert read.memory_bytes == 40 * 2**30 and read.peak("bfloat16") == 3e14
    assert read.source("peak_flops.bfloat16") == "declared in ours.toml"
    assert resolve(str(path)) == read


def test_a_full_declaration_round_trips_through_json(tmp_path):
    path = tmp_path / "copy.json"
    path.write_text(json.dumps(get("mi300x").to_dict()))
    assert load(path) == get("mi300x")


def test_missing_fields_are_named():
    with pytest.raises(HardwareError, match="memory_bandwidth"):
        from_dict({"name": "x", "peak_flops": {"bfloat16": 1e12}, "memory_bytes": 1e9})
    with pytest.raises(HardwareError, match="did you mean 'memory_bandwidth'"):
        from_dict({"base": "l4", "memory_bandwith": 1e11})


@pytest.mark.parametrize(
    "text",
    [
        '{"base": "h100-sxm", "memory_bandwidth": "os:system"}',
        '{"base": "h100-sxm", "__reduce__": ["os.system", ["echo hi"]]}',
        '{"base": "h100-sxm", "network": {"bandwidth": {"$class": "os:system"}}}',
        '{"base": "h100-sxm", "gemm": {"bfloat16": {"points": [["1", 0.8]], "source": "x"}}}',
        '{"base": "os:system"}',
        "[" * 200 + "]" * 200,
    ],
)
def test_a_file_naming_code_is_refused_and_imports_nothing(tmp_path, text):
    before = set(sys.modules)
    path = tmp_path / "hostile.json"
    path.write_text(text)
    with pytest.raises((HardwareError, UntrustedInputError)):
        load(path)
    assert set(sys.modules) - before <= {"tomllib"}


def test_deep_toml_and_odd_files_are_refused(tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises((HardwareError, UntrustedInputError)):
        load(deep)
    with pytest.raises(HardwareError):
        load(tmp_path / "cluster.yaml")
    with pytest.raises(UntrustedInputError):
        load(tmp_path / "absent.json")


def test_a_hardware_passes_through_resolve():
    hw = get("l4")
    assert resolve(hw) is hw and isinstance(resolve("L4"), Hardware)

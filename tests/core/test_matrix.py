"""Every registered transform is exercised; a transform without a case fails the suite."""

import pytest

import composable_atorch as ca

from _dist import run_world
from matrix import all_cases, configs, order_violations, run_all_configs, run_cases_in_group

CASES = all_cases()


def test_every_registered_transform_has_a_case():
    missing = sorted(set(ca.registry()) - set(CASES))
    assert not missing, f"registered transforms with no matrix case (add them to a tests/cases_*.py): {missing}"
    stale = sorted(set(CASES) - set(ca.registry()))
    assert not stale, f"matrix cases for transforms that are not registered: {stale}"


def _check(result):
    name = result["name"]
    assert result["finite"], f"{name}: losses {result['losses']}"
    steps = result["requested_names"] if result["expands"] else result["step_names"]
    assert name in steps, f"{name} missing from the plan's steps {steps}"
    assert name in result["explain"]
    assert result["roundtrip_equal"], f"{name}: JSON round-trip gave a different plan"
    if result["names_required"]:
        assert result["names_kept"], f"{name} ({result['config']}): parameter names changed"
        assert result["count_kept"], f"{name} ({result['config']}): parameter count changed {result['counts']}"
    assert result["optimizer_once"], f"{name}: optimizer does not hold each parameter exactly once"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.world == 1))
def test_single_process_case(name):
    results = run_all_configs(name)
    for result in results:
        _check(result)


@pytest.mark.parametrize("name", sorted(CASES))
def test_composition_is_order_independent(name):
    assert order_violations(name) == []


def test_transforms_with_several_configs_are_checked_in_each():
    several = {n: len(configs(n)) for n in CASES if CASES[n].world == 1}
    assert several["checkpoint"] >= 3 and several["accumulate"] >= 2, several  # candidates join the matrix
    assert {t.policy for t in configs("checkpoint")} == {"full", "selective"}


WORLDS = sorted({c.world for c in CASES.values() if c.world > 1})


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
def test_distributed_cases(world):
    names = sorted(n for n, c in CASES.items() if c.world == world)
    per_rank = run_world(run_cases_in_group, world, names, timeout=900)
    for results in per_rank:
        for result in results:
            _check(result)


def _nothing():
    pass


def test_an_unmarked_test_cannot_spawn_a_python_process():
    """The fast tier's guard (tests/conftest.py): spawning a fresh Python process needs the dist mark."""
    import multiprocessing
    import subprocess
    import sys

    with pytest.raises(RuntimeError, match="not marked dist"):
        multiprocessing.get_context("spawn").Process(target=_nothing).start()
    with pytest.raises(RuntimeError, match="not marked dist"):
        subprocess.run([sys.executable, "-c", "pass"])

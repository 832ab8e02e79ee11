"""``python -m composable_atorch estimate / explain / --help`` in a fresh process: a compiled plan on a
Llama-3-8B shape at world 8 returns (exit 0, not a signal), and no command prints an optional
package's import-time noise the user did not cause (torchao's "Failed to load ..._C*.so" lines and
torch's pytree deprecation warnings, which transformers' import of torchao used to print before
anything the user asked for)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import composable_atorch as ca

#: what a third-party package prints about itself: loader failures, Python warnings, torch's and
#: DeepSpeed's log lines at warning level
NOISE = re.compile(
    r"Failed to load|DeprecationWarning|FutureWarning|UserWarning|ExperimentalWarning|\[WARNING\]|"
    r"^(\[rank\d+\]:)?[WE]\d{4} |is an Enum subclass",
    re.M,
)


def run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "composable_atorch", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory):
    """``fsdp | amp | checkpoint | compile`` naming Llama's block, as a file."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text((ca.fsdp() | ca.amp("bf16") | ca.checkpoint(LlamaDecoderLayer) | ca.compile()).to_json())
    return path


@pytest.mark.dist  # a fresh process: the point is what it prints and how it exits
def test_estimate_of_a_compiled_plan_on_llama3_8b_at_world_8_exits_0_without_noise(plan_json):
    proc = run(
        "estimate",
        str(plan_json),
        "--model",
        "llama3-8b",
        "--world-size",
        "8",
        "--device",
        "cuda",
        "--batch",
        "1",
        "--seq",
        "2048",
        "--device-memory",
        "141GiB",
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -11 was inductor's SIGSEGV
    assert "compile(inductor, per repeated block): simulated eagerly" in proc.stdout
    assert "fits in 141GiB" in proc.stdout
    assert not NOISE.search(proc.stderr), proc.stderr[-3000:]


@pytest.mark.dist
def test_explain_of_a_plan_naming_a_transformers_class_prints_no_noise(plan_json):
    proc = run("explain", str(plan_json), "--trust", "transformers.models.llama.modeling_llama")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compile" in proc.stdout
    assert not NOISE.search(proc.stderr), proc.stderr[-3000:]


@pytest.mark.dist
@pytest.mark.parametrize("args", [("--help",), ("estimate", "--help"), ("explain", "--help"), ("search", "--help")])
def test_help_prints_no_noise(args):
    proc = run(*args, timeout=120)
    assert proc.returncode == 0 and "usage" in proc.stdout
    assert proc.stderr == "", proc.stderr


def test_the_noise_is_held_back_only_inside_the_command():
    """quiet_imports drops just its lines, and only in its block: torchao's other warnings still print."""
    import logging

    from composable_atorch.environment import quiet_imports

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("torchao")
    handler = Keep()
    logger.addHandler(handler)
    try:
        with quiet_imports():
            logger.warning("Failed to load /x/_C_mxfp8.so: no such library")
            logger.warning("something else")
        logger.warning("Failed to load /x/_C_mxfp8.so: outside")
    finally:
        logger.removeHandler(handler)
    assert records == ["something else", "Failed to load /x/_C_mxfp8.so: outside"]


def test_search_report_figures_keep_optunas_caveats_off_the_console(recwarn, caplog):
    """The search report's figures: with no complete trial none is drawn (optuna logged a warning per
    plot), with one optuna's "too few trials" warning becomes the figure's note."""
    optuna = pytest.importorskip("optuna")
    from composable_atorch.auto.report import figures

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params={}, distributions={}))
    assert [(fig, note) for _, fig, note in figures(study)] == [(None, "not drawn: no trial completed")] * 3
    dist = optuna.distributions.FloatDistribution(0, 1)
    study.add_trial(optuna.trial.create_trial(value=1.0, params={"x": 0.5}, distributions={"x": dist}))
    notes = {title: note for title, _, note in figures(study)}
    assert "too small" in notes["parameter importances"]
    assert not [w for w in recwarn if "optuna" in w.filename]
    assert not [r for r in caplog.records if r.name.startswith("optuna")]

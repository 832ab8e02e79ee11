"""Plans are data: a hostile plan file never imports a module, runs code, blocks, or recurses untyped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import composable_atorch as ca
from composable_atorch import strategy
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, UntrustedInputError
from composable_atorch.models import Block

CPU = Environment()
WORLD4 = Environment.detect().with_(world_size=4)
REPO = Path(__file__).resolve().parents[2]


def batch_to_pipe(batch):
    """A module-level batch function: what a plan may name with $function."""
    return (batch[0],), (batch[1],)


def _evil_module(directory: Path, name: str) -> Path:
    """A module whose import leaves a marker file: if the marker exists, the plan ran code."""
    marker = directory / f"{name}.ran"
    (directory / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\nimport torch\nclass Block(torch.nn.Module):\n    pass\n"
    )
    return marker


def _checkpoint_plan(path: str) -> str:
    plan = json.loads(ca.compose(ca.checkpoint(Block), env=CPU).to_json())
    plan["transforms"][0]["config"]["targets"] = [{"$class": path}]
    return json.dumps(plan)


def test_a_class_path_never_imports_its_module(tmp_path, monkeypatch):
    marker = _evil_module(tmp_path, "evil_plan_module")
    monkeypatch.syspath_prepend(str(tmp_path))
    text = _checkpoint_plan("evil_plan_module:Block")
    for load in (lambda: strategy.load(text, env=CPU), lambda: ca.Plan.from_json(text, env=CPU)):
        with pytest.raises(UntrustedInputError, match="has imported.*allow="):
            load()
    seed_list = json.dumps([["checkpoint", [{"$class": "evil_plan_module:Block"}]]])
    with pytest.raises(UntrustedInputError):
        strategy.load(seed_list, env=CPU)
    assert not marker.exists() and "evil_plan_module" not in sys.modules


@pytest.mark.dist
def test_explain_cli_imports_nothing_from_the_plan_or_the_current_directory(tmp_path):
    marker = _evil_module(tmp_path, "evil_cli_module")
    # a module in the current directory shadowing one the CLI imports lazily
    shadow = tmp_path / "argparse_shadow.ran"
    (tmp_path / "deepspeed.py").write_text(f"open({str(shadow)!r}, 'w').write('imported')\n")
    plan = tmp_path / "plan.json"
    plan.write_text(_checkpoint_plan("evil_cli_module:Block"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "composable_atorch", "explain", str(plan)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "evil_cli_module:Block" in run.stdout and "--trust" in run.stdout
    assert not marker.exists() and not shadow.exists()
    good = tmp_path / "good.json"
    good.write_text(ca.compose(ca.checkpoint(Block), env=CPU).to_json())
    run = subprocess.run(
        [sys.executable, "-m", "composable_atorch", "explain", str(good)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "checkpoint" in run.stdout, run.stdout + run.stderr


def test_process_launchers_are_no_block_class_nor_batch_function(tmp_path, monkeypatch):
    with pytest.raises(UntrustedInputError, match="standard library"):
        strategy.load(_checkpoint_plan("subprocess:Popen"), env=CPU)
    # explicitly allowed, the field's kind check still refuses it
    with pytest.raises(ConfigError, match="nn.Module subclass"):
        strategy.load(_checkpoint_plan("subprocess:Popen"), env=CPU, allow=[subprocess.Popen])
    # a user module re-exporting Popen does not launder it
    (tmp_path / "reexport_mod.py").write_text("from subprocess import Popen\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("reexport_mod")
    with pytest.raises(UntrustedInputError, match="own module"):
        strategy.load(_checkpoint_plan("reexport_mod:Popen"), env=CPU)
    for field in ("batch_fn", "logit_helper"):
        with pytest.raises(ConfigError, match="not a class"):
            ca.ds_3d_parallel(**{field: subprocess.Popen})
        plan = json.loads(
            ca.compose(
                ca.parallel_mode([("data", 2), ("pipeline", 2)]),
                ca.ds_3d_parallel(**{field: batch_to_pipe}),
                env=WORLD4,
            ).to_json()
        )
        entry = next(t for t in plan["transforms"] if t["name"] == "ds_3d_parallel")
        assert entry["config"][field] == {"$function": f"{__name__}:batch_to_pipe"}
        assert ca.Plan.from_dict(plan, env=WORLD4).transforms[-1].config()[field] is batch_to_pipe
        entry["config"][field] = {"$class": "subprocess:Popen"}
        with pytest.raises(UntrustedInputError):
            ca.Plan.from_dict(plan, env=WORLD4)
        with pytest.raises(ConfigError, match="not a class"):
            ca.Plan.from_dict(plan, env=WORLD4, allow=[subprocess.Popen])
        entry["config"][field] = {"$function": "json:dumps"}  # stdlib: only when the user allows it
        with pytest.raises(UntrustedInputError, match="standard library"):
            ca.Plan.from_dict(plan, env=WORLD4)
        allowed = ca.Plan.from_dict(plan, env=WORLD4, allow=[json.dumps])
        assert allowed.transforms[-1].config()[field] is json.dumps


def _finishes(fn, seconds=60):
    """Run ``fn`` in a thread; the exception it raised, or a failure if it blocked."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked on the file"
    return out.get("exc")


def test_a_fifo_is_never_opened(tmp_path):
    fifo = tmp_path / "ds_config.json"
    os.mkfifo(fifo)
    exc = _finishes(lambda: ca.ds_3d_parallel(ds_config=str(fifo)))
    assert isinstance(exc, UntrustedInputError) and "regular" in str(exc)
    plan = json.loads(
        ca.compose(
            ca.parallel_mode([("data", 2), ("pipeline", 2)]), ca.ds_3d_parallel(ds_config={"a": 1}), env=WORLD4
        ).to_json()
    )
    plan["transforms"][-1]["config"]["ds_config"] = str(fifo)
    exc = _finishes(lambda: strategy.load(json.dumps(plan), env=WORLD4))
    assert isinstance(exc, UntrustedInputError) and "ds_config" in str(exc)
    from composable_atorch.transforms.parallel.ds3d.engine import read_ds_config

    exc = _finishes(lambda: read_ds_config(str(fifo)))  # the apply-time read refuses it too
    assert isinstance(exc, UntrustedInputError)
    plan_fifo = tmp_path / "plan.json"
    os.mkfifo(plan_fifo)
    exc = _finishes(lambda: strategy.load(plan_fifo, env=CPU))
    assert isinstance(exc, ConfigError)


def test_ds_config_files_are_bounded(tmp_path):
    from composable_atorch.core import untrusted
    from composable_atorch.transforms.parallel.ds3d.engine import read_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    t = ca.ds_3d_parallel(ds_config=str(path))  # only stat-ed here
    assert read_ds_config(t.config()["ds_config"]) == {"train_micro_batch_size_per_gpu": 1}
    path.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(UntrustedInputError, match="nest"):
        read_ds_config(str(path))
    with pytest.raises(UntrustedInputError, match="at most 10 bytes"):
        untrusted.read_regular_file(path, "x", limit=10)


def test_deep_nesting_is_a_typed_error_not_recursion(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(UntrustedInputError, match="nest"):
        strategy.load(deep, env=CPU)
    plan = json.loads(ca.compose(ca.checkpoint(Block), env=CPU).to_json())
    nested: dict = {}
    inner = nested
    for _ in range(5000):
        inner["x"] = {}
        inner = inner["x"]
    plan["transforms"][0]["config"]["extra"] = nested
    with pytest.raises(UntrustedInputError, match="nest"):
        ca.Plan.from_dict(plan, env=CPU)
    text = json.dumps({"format": "composable_atorch.plan", "version": 1, "transforms": [], "x": '"[[[[' * 100})
    assert ca.Plan.from_json(text, env=CPU).names == ()  # brackets inside strings do not count
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (17 * 1024 * 1024))
    with pytest.raises(UntrustedInputError, match="at most"):
        strategy.load(big, env=CPU)


def test_registered_names_and_allow_list_api():
    with pytest.raises(UntrustedInputError, match="standard library"):
        ca.Plan.from_dict(_ds3d_with({"$function": "os.path:basename"}), env=WORLD4)
    strategy.allow(os.path.basename)
    try:
        plan = ca.Plan.from_dict(_ds3d_with({"$function": "posixpath:basename"}), env=WORLD4)
        assert plan.transforms[-1].config()["batch_fn"] is os.path.basename
    finally:
        from composable_atorch.core import codec

        codec._REGISTERED.clear()
    with pytest.raises(ConfigError, match="classes or module-level functions"):
        strategy.load("[]", env=CPU, allow=[42])


def _ds3d_with(batch_fn) -> dict:
    plan = json.loads(
        ca.compose(
            ca.parallel_mode([("data", 2), ("pipeline", 2)]), ca.ds_3d_parallel(batch_fn=batch_to_pipe), env=WORLD4
        ).to_json()
    )
    plan["transforms"][-1]["config"]["batch_fn"] = batch_fn
    return plan


def test_a_name_that_is_no_class_or_function_is_refused():
    from composable_atorch.core import codec

    for path in ("torch:float32", "composable_atorch.core.codec:MAX_DEPTH", "torch:os", "torch:nn", "x:y;z"):
        with pytest.raises(UntrustedInputError):
            codec.resolve(path)
    assert codec.resolve("composable_atorch.models.gpt:Block") is Block


def test_the_users_own_objects_are_trusted_where_the_library_reads_its_own_plan_back(monkeypatch):
    """Issue 30: a block class defined in the user's script, in a ``torch.multiprocessing.spawn``
    child (the script runs as ``__mp_main__`` there), was refused when auto_accelerate read back its
    own plan. The plan names it ``__main__:...`` whichever name the script runs under; the objects
    a plan holds (Plan.named_objects) are trusted when passed back; text naming ``__mp_main__:...``
    from elsewhere still goes through the allow-list."""
    import types

    script = types.ModuleType("__mp_main__")
    local_block = type("ScriptBlock", (Block,), {"__module__": "__mp_main__"})
    script.ScriptBlock = local_block
    monkeypatch.setitem(sys.modules, "__mp_main__", script)
    plan = ca.compose(ca.checkpoint(local_block), env=CPU)
    assert plan.named_objects() == (local_block,)
    text = plan.to_json()
    assert '"__main__:ScriptBlock"' in text  # one spelling for torchrun's __main__ and spawn's __mp_main__
    assert ca.Plan.from_json(text, env=CPU, allow=plan.named_objects()) == plan
    foreign = text.replace("__main__:ScriptBlock", "__mp_main__:ScriptBlock")
    with pytest.raises(UntrustedInputError, match="__mp_main__:ScriptBlock"):
        ca.Plan.from_json(foreign, env=CPU)  # text from elsewhere: the allow-list decides
    assert ca.Plan.from_json(foreign, env=CPU, allow=[local_block]) == plan  # an older plan, the object given

"""benchmarks/_accelerate_run.py refuses an Accelerate that does not run distributed (issue 31): without
ACCELERATE_USE_CPU=1 on a CPU, Accelerate under torchrun runs one unsynchronised process per rank and an
A/B against it is wrong."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "_accelerate_run.py"
_spec = importlib.util.spec_from_file_location("_accelerate_run", RUN)
accelerate_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accelerate_run)


def test_an_accelerate_that_is_not_distributed_is_refused_naming_the_fix(capsys):
    alone = SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO")
    with pytest.raises(SystemExit) as exit_:
        accelerate_run.check_distributed(alone, 2)
    assert exit_.value.code == 2 and "ACCELERATE_USE_CPU=1" in capsys.readouterr().err
    accelerate_run.check_distributed(SimpleNamespace(num_processes=2, distributed_type="DistributedType.MULTI_CPU"), 2)
    accelerate_run.check_distributed(alone, 1)  # one process asked for, one run: nothing to refuse


@pytest.mark.dist
def test_under_torchrun_without_accelerate_use_cpu_the_comparison_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(RUN)]
    cmd += ["--small", "--steps", "1", "--warmup", "1", "--versus", "ddp", "--out", str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "ACCELERATE_USE_CPU=1" in proc.stderr and "DistributedType.NO" in proc.stderr, proc.stderr[-2000:]

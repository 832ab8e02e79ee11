"""fsdp / zero2 per-rank parameter bytes at worlds 8 and 16, checked on torch's fake process group."""

import pytest

from _dist import context
from fake_world import child


def _run(*args):
    ctx = context()  # a fresh process started from the preloaded forkserver
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue, *args), daemon=True)
    proc.start()
    try:
        status, value = queue.get(timeout=240)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    return value


@pytest.mark.parametrize("world, rank", [(8, 0), (16, 5)])
@pytest.mark.parametrize("name", ["fsdp", "zero2"])
def test_sharded_bytes_per_rank_are_one_over_world(world, rank, name):
    out = _run(world, rank, name)
    assert out["world"] == world
    assert out["steps"] == ("parallel_mode", name)
    # FSDP2 shards dim 0 of every parameter; padding may add at most one row per parameter
    assert out["local"] <= out["full"] / world * 1.05, out
    assert out["local"] >= out["full"] / world * 0.95, out

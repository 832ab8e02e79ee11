"""Layouts of worlds we don't have, in one process, on torch's fake process group.

Shapes, placements and per-rank bytes are real; collectives are no-ops (CPU_FACTS). Run in a
process of its own (see test_fake_world.py) so the fake group never leaks into the test process.
"""

from __future__ import annotations


def per_rank_fraction(world: int, rank: int, transform_name: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import composable_atorch as ca
    from composable_atorch.models import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=64, n_layer=4))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        transform = {"fsdp": lambda: ca.fsdp(wrap=(Block,)), "zero2": lambda: ca.zero2()}[transform_name]()
        plan = ca.compose(transform)
        model, _, _ = plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        return {
            "world": plan.env.world_size,
            "steps": plan.names,
            "full": full,
            "local": local,
            "shapes": [tuple(p.to_local().shape) for p in model.parameters()][:3],
        }
    finally:
        dist.destroy_process_group()


def child(queue, *args):
    try:
        queue.put(("ok", per_rank_fraction(*args)))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        import traceback

        queue.put(("error", f"{exc!r}\n{traceback.format_exc()}"))

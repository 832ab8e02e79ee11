"""Per-rank training-state bytes of ds_3d_parallel (DeepSpeed pipeline x tensor x data) at world 4.

    python benchmarks/memory_ds3d.py            # pp2 x dp2 and tp2 x pp2 on a tiny Llama, 4 gloo processes

For benchmarks/memory.py to merge: :func:`ds3d_layout_state` runs inside one gloo rank (as
``gloo_layout_state`` does for the torch-native families) and :func:`measure_ds3d` spawns the world.
Counted exactly, per rank, over one real ``train_batch`` (forward, backward, AdamW step): the bytes of
the stage's parameters (each rank builds only its stage's layers, sharded over the tensor ranks),
of their gradients (seen by a post-accumulate hook, before the engine's step clears them), and of
the optimizer state (the torch AdamW's ``exp_avg`` / ``exp_avg_sq``; at ZeRO-1 DeepSpeed's fp32
partitions and their state instead). The tied embedding, when tied, is counted on both stages that
hold a copy (it really is held twice). Expected: each rank's parameters are about
``whole / (tensor x pipeline)``, the data ranks hold equal copies at ZeRO-0.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

LLAMA_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
#: (tensor, pipeline, data) rows at world 4
DS3D_ROWS = ((1, 2, 2), (2, 2, 1))


def _bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def ds3d_layout_state(
    tensor: int, pipeline: int, data: int, sizes: dict = LLAMA_TINY, *, zero_stage: int = 0, seq_len: int = 16
) -> dict:
    """Inside a gloo rank of world ``tensor * pipeline * data``: build, train one batch, count this rank's bytes."""
    from torch.nn import functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    import composable_atorch as ca

    with ca.record_module_init():
        meta = LlamaForCausalLM(LlamaConfig(**sizes))
    info = None
    if tensor > 1:
        info = ca.TPInfo().shard_col(
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"
        )
        info.shard_row("self_attn.o_proj", "mlp.down_proj").shard_vocab("embed_tokens")
    micro, steps = 2, 2
    cfg = ca.DeepSpeed3DParallelConfig(
        tpinfo=info,
        tie_first=bool(sizes.get("tie_word_embeddings")),
        ds_config={
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": steps,
            "zero_optimization": {"stage": zero_stage},
        },
    )
    groups = [("tensor", tensor), ("data", data), ("pipeline", pipeline)]

    def loss(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))

    _, result, _ = ca.auto_accelerate(
        meta,
        torch.optim.AdamW,
        optim_args={"lr": 1e-3},
        loss_func=loss,
        load_strategy=[("parallel_mode", (groups, None)), ("ds_3d_parallel", cfg)],
    )
    engine = result.model
    params = list(engine.module.parameters())
    grads: dict[int, int] = {}
    handles = [p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(id(p), _bytes(p.grad))) for p in params]
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, sizes["vocab_size"], (micro * steps, seq_len), generator=g) for _ in range(2))
    engine.train_batch(iter(list(zip(x.split(micro), y.split(micro), strict=True))))
    for h in handles:
        h.remove()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    opt = sum(_bytes(v) for s in inner.state.values() for v in s.values())
    p_bytes = sum(_bytes(p) for p in params)
    if zero_stage:  # DeepSpeed's ZeRO-1 keeps fp32 partitions of the parameters besides the module's
        opt += sum(
            _bytes(t)
            for group in getattr(engine.optimizer, "single_partition_of_fp32_groups", [])
            for t in ([group] if isinstance(group, torch.Tensor) else group)
        )
    row = {"params": p_bytes, "grads": sum(grads.values()), "optimizer": opt}
    row["total"] = sum(row.values())
    return {**row, "layout": f"tp{tensor} x pp{pipeline} x dp{data}", "zero": zero_stage, "source": "gloo"}


def whole_state(sizes: dict = LLAMA_TINY) -> dict:
    """The whole model in one process: parameters, gradients and AdamW state (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    n = sum(_bytes(p) for p in model.parameters())
    return {"params": n, "grads": n, "optimizer": 2 * n, "total": 4 * n}


def _rank(rank: int, world: int, init_file: str, out_dir: str, rows, sizes) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = [ds3d_layout_state(t, p, d, sizes) for t, p, d in rows]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def measure_ds3d(world: int = 4, rows=DS3D_ROWS, sizes: dict = LLAMA_TINY) -> list[list[dict]]:
    """``[rank][row]`` state bytes of each (tensor, pipeline, data) row whose product is ``world``."""
    import torch.multiprocessing as mp

    rows = [r for r in rows if r[0] * r[1] * r[2] == world]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "init"), tmp, rows, sizes), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> int:
    per_rank = measure_ds3d(4)
    whole = whole_state()
    mib = 2**20
    print(
        f"ds_3d_parallel per-rank state at world 4, Llama hidden {LLAMA_TINY['hidden_size']}, "
        f"{LLAMA_TINY['num_hidden_layers']} layers, fp32 + AdamW, ZeRO-0"
    )
    print(
        f"{'layout':<18}{'rank':>5}{'params MiB':>12}{'grads MiB':>11}{'optim MiB':>11}{'total MiB':>11}{'x whole':>9}"
    )
    print(
        f"{'whole model':<18}{'-':>5}{whole['params'] / mib:>12.3f}{whole['grads'] / mib:>11.3f}"
        f"{whole['optimizer'] / mib:>11.3f}{whole['total'] / mib:>11.3f}{1:>9.3f}"
    )
    for i in range(len(per_rank[0])):
        for rank, rows in enumerate(per_rank):
            r = rows[i]
            print(
                f"{r['layout']:<18}{rank:>5}{r['params'] / mib:>12.3f}{r['grads'] / mib:>11.3f}"
                f"{r['optimizer'] / mib:>11.3f}{r['total'] / mib:>11.3f}{r['total'] / whole['total']:>9.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

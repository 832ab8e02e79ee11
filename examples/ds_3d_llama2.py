"""ATorch's DS 3D example, the library's way: a Hugging Face Llama in DeepSpeed pipeline x tensor x data parallelism.

(ATorch's script itself, ported in its imports only, is ``atorch_llama2/ds_3d_llama2.py``.)

The model is built unmodified on the meta device (``record_module_init``); ``ds_3d_parallel`` turns
it into a DeepSpeed ``PipelineEngine`` whose stages build only their own layers, sharded over the
tensor ranks per the TPInfo. ATorch's environment knobs set the degrees (the data size is the
rest of the world): ``PIPELINE_PARALLEL_SIZE`` (default 2), ``MODEL_PARALLEL_SIZE`` (tensor, default
1), ``MICRO_BATCH_SIZE`` (default 2), ``ACCU_STEPS`` (micro-batches per step, default 4).

Tiny, on this CPU (a 4-layer Llama from a config, byte tokens of text every Python ships)::

    python -m composable_atorch launch --nproc 4 examples/ds_3d_llama2.py                          # pp2 x dp2
    MODEL_PARALLEL_SIZE=2 python -m composable_atorch launch --nproc 4 examples/ds_3d_llama2.py    # tp2 x pp2

Full size (ATorch's run: 8 GPUs, mp 2 x pp 2 x dp 2, a DeepSpeed JSON config)::

    PIPELINE_PARALLEL_SIZE=2 MODEL_PARALLEL_SIZE=2 MODEL_NAME_OR_PATH=meta-llama/Llama-2-7b-hf \\
        python -m composable_atorch launch --nproc 8 examples/ds_3d_llama2.py \\
        --ds_config ds_config.json --block_size 4096
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.nn import functional as F

from composable_atorch import (
    DeepSpeed3DParallelConfig,
    TPInfo,
    auto_accelerate,
    create_parallel_group,
    init_distributed,
    record_module_init,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--ds_config", default=None, help="a DeepSpeed JSON config (micro-batch, accumulation, precision, ZeRO 0/1...)"
)
parser.add_argument("--block_size", type=int, default=32, help="tokens per sample")
parser.add_argument("--max_steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()


def get_llama_tpinfo() -> TPInfo:
    """ATorch's Llama TPInfo (transformers 5 reshapes heads by head_dim, so nothing needs shrinking)."""
    info = TPInfo()
    info.shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    info.shard_row("self_attn.o_proj", "mlp.down_proj")
    info.shard_vocab("embed_tokens")
    return info


def my_loss_func(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


def main():
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from composable_atorch.data.text import ByteTokenizer, corpus_text

    init_distributed("gloo")
    world = torch.distributed.get_world_size()
    tensor_size = int(os.environ.get("MODEL_PARALLEL_SIZE", 1))
    pipeline_size = int(os.environ.get("PIPELINE_PARALLEL_SIZE", 2))
    if world % (tensor_size * pipeline_size):
        raise SystemExit(
            f"world {world} is not divisible by MODEL_PARALLEL_SIZE {tensor_size} x PIPELINE_PARALLEL_SIZE "
            f"{pipeline_size}"
        )
    data_size = world // (tensor_size * pipeline_size)
    groups = [("tensor", tensor_size), ("data", data_size), ("pipeline", pipeline_size)]
    pc = create_parallel_group((groups, None))
    rank0 = pc.rank == 0
    if rank0:
        print(f"3D parallel: tensor {tensor_size}, data {data_size}, pipeline {pipeline_size}")

    model_path = os.environ.get("MODEL_NAME_OR_PATH")
    if model_path:
        config = AutoConfig.from_pretrained(model_path)
    else:  # tied embeddings: ATorch's tie_first (the embedding computes the logits on the last stage)
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.block_size,
            tie_word_embeddings=True,
        )
    with record_module_init():
        meta_model = LlamaForCausalLM(config)  # nothing allocated

    ds_config = args.ds_config or {
        "train_micro_batch_size_per_gpu": int(os.environ.get("MICRO_BATCH_SIZE", 2)),
        "gradient_accumulation_steps": int(os.environ.get("ACCU_STEPS", 4)),
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
    }
    cfg = DeepSpeed3DParallelConfig(
        tpinfo=get_llama_tpinfo(), tie_first=bool(config.tie_word_embeddings), ds_config=ds_config
    )
    strategy = [
        ("parallel_mode", (groups, None)),
        ("deepspeed_3d_parallel", cfg),
        "module_replace",  # attn fa (as ATorch's script): applied to each layer a stage builds
    ]
    status, result, best_strategy = auto_accelerate(
        meta_model,
        torch.optim.AdamW,
        optim_args={"lr": args.lr},
        loss_func=my_loss_func,
        load_strategy=strategy,
        ignore_dryrun_on_load_strategy=True,
    )
    if not status:
        raise SystemExit("auto_accelerate found no plan")
    model = result.model  # a DeepSpeed PipelineEngine
    if rank0:
        print(best_strategy.explain())
        print(f"Global batch size: {model.train_batch_size()}")

    # this data rank's shard of next-token windows, micro-batch by micro-batch, repeated forever
    tokens = ByteTokenizer().encode(corpus_text())
    n = len(tokens) // (args.block_size + 1)
    windows = tokens[: n * (args.block_size + 1)].view(n, args.block_size + 1)[pc.data_rank :: pc.data_size]
    micro = model.train_micro_batch_size_per_gpu()

    def data_iter():
        while True:
            for i in range(0, len(windows) - micro + 1, micro):
                w = windows[i : i + micro]
                yield w[:, :-1].contiguous(), w[:, 1:].contiguous()

    it = data_iter()
    losses = []
    for step in range(args.max_steps):
        loss = float(model.train_batch(it))
        losses.append(loss)
        if rank0:
            print(f"iter: {step}, loss: {loss:.4f}", flush=True)
    if rank0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({'falling' if losses[-1] < losses[0] else 'NOT falling'})")


if __name__ == "__main__":
    main()

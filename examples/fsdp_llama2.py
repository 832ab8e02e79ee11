"""ATorch's FSDP example: a Hugging Face Llama through ``auto_accelerate`` with a load_strategy.

fsdp wrapping the decoder layer, amp_native bf16, activation checkpointing of the decoder layer;
``USE_LORA=1`` trains a peft LoRA adapter (frozen base sharded per layer, the trainable adapter in
the root group: ``fsdp_wrap_params_outmost``) and saves the adapter alone; ``USE_FP8=1`` adds fp8
Linear layers with ``lm_head`` left out.

Tiny, on this CPU (a 2-layer Llama from a config, byte tokens of text every Python ships)::

    python -m composable_atorch launch --nproc 2 examples/fsdp_llama2.py --out runs/fsdp_llama2
    USE_LORA=1 python -m composable_atorch launch --nproc 2 examples/fsdp_llama2.py
    USE_FP8=1  python -m composable_atorch launch --nproc 2 examples/fsdp_llama2.py   # emulated on CPU

Full size on GPUs (ATorch's Llama2-7B on 8 GPUs; fp8 needs transformer-engine or torchao on
sm89+; pass ``--nnodes/--node-rank/--rdzv-endpoint`` for several nodes)::

    MODEL_NAME_OR_PATH=meta-llama/Llama-2-7b-hf python -m composable_atorch launch --nproc 8 \\
        examples/fsdp_llama2.py --seq-len 4096 --batch-size 32 --steps 1000

With ``MODEL_NAME_OR_PATH`` the model and tokenizer come from that directory (or the Hub).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from composable_atorch import auto_accelerate
from composable_atorch.state.hf import save_pretrained
from composable_atorch.state.trackers import init_trackers

from _llama_data import Windows, llama_and_tokens  # beside this script (the Llama examples share it)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="runs/fsdp_llama2")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=4, help="the global batch")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
use_lora = os.environ.get("USE_LORA") == "1"
use_fp8 = os.environ.get("USE_FP8") == "1"
model_path = os.environ.get("MODEL_NAME_OR_PATH")

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()

model, tokens = llama_and_tokens(model_path, args.seq_len)
dataset = Windows(tokens, args.seq_len, args.batch_size * args.steps)

fsdp_config = {"atorch_wrap_cls": (LlamaDecoderLayer,)}
if use_lora:
    from peft import LoraConfig, TaskType, get_peft_model

    model = get_peft_model(
        model,
        LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    )
    fsdp_config["fsdp_wrap_params_outmost"] = True  # frozen base shards per layer, adapters in the root group
strategy = [("fsdp", fsdp_config), ("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", (LlamaDecoderLayer,))]
if use_fp8:
    strategy.insert(0, ("fp8", {"exclude": ["lm_head"]}))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter only


status, result, best_strategy = auto_accelerate(
    model,
    torch.optim.AdamW,
    dataset,
    loss_func=lambda data, output: output.loss,
    model_input_format="unpack_dict",
    optim_args={"lr": args.lr},
    optim_param_func=trainable,
    dataloader_args={"batch_size": args.batch_size, "shuffle": True, "drop_last": True},
    load_strategy=strategy,
)
if not status:
    raise SystemExit("auto_accelerate found no plan")
model, optim, loader = result.model, result.optim, result.dataloader
if rank == 0:
    print(best_strategy.explain())
    print(
        f"trainable parameters: {sum(p.numel() for p in trainable(model))} in {len(trainable(model))} tensors"
        f"{' (LoRA adapter)' if use_lora else ''}"
    )
    if use_fp8:
        kinds = {
            n.rsplit(".", 1)[-1]: type(m).__name__
            for n, m in model.named_modules()
            if n.endswith(("q_proj", "lm_head"))
        }
        print(f"fp8: q_proj is {kinds['q_proj']}, lm_head is {kinds['lm_head']} (excluded)")

device = next(model.parameters()).device
tracking = init_trackers(
    "fsdp_llama2",
    log_with="jsonl",
    project_dir=args.out,
    config={**vars(args), "lora": use_lora, "fp8": use_fp8},
    plan=best_strategy,
)
step = 0
with tqdm(total=args.steps, disable=rank != 0, desc="training") as bar:
    while step < args.steps:
        for batch in loader:
            output = model(**result.prepare_input(batch, device))
            loss = result.loss_func(batch, output)
            if result.args.use_optim_backward:
                optim.backward(loss)
            else:
                loss.backward()
            optim.step()
            optim.zero_grad()
            step += 1
            tracking.log({"loss": loss}, step=step)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
            if step == args.steps:
                break
tracking.finish()
path = save_pretrained(model, os.path.join(args.out, "final"))  # LoRA: adapter_config.json + adapter_model.safetensors
if rank == 0:
    print(f"saved {sorted(p.name for p in path.iterdir())} to {path}")
dist.destroy_process_group()

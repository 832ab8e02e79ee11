"""``python -m composable_atorch estimate PLAN.json --model gpt|llama-7b|llama3-8b|hf:<config.json> ...``

Prints each rank's predicted memory (parameters, gradients, optimizer state, activations,
temporary buffers, peak) and whether it fits ``--device-memory`` (default: the ``--gpu``'s memory),
and on CUDA the step priced on paper for ``--gpu`` (a catalog name such as h100-sxm, or a .json /
.toml declaration) over ``--nodes`` machines: seconds per step, tokens/s, model TFLOP/s, MFU and HFU
per device. Nothing real is allocated: the model is built on the meta device and simulated (see
``composable_atorch.estimate``). ``--json`` carries ``step_time_s``, ``tokens_per_s_per_device``,
``tflops_per_device``, ``mfu``, ``hfu``, ``peak_bytes`` and ``fits``.

``--batch`` is the batch *per data-parallel rank* (as in published tables); the global batch the
plan's loader sees is ``batch x world_size / (tensor x pipeline degree)``, computed by the estimate
itself from the plan. Token ids of ``--seq`` stand for the batch; the loss is the model's own (HF)
or next-token cross-entropy.
"""

from __future__ import annotations

import argparse
import json

import torch

from composable_atorch.errors import CompositionError

#: Llama-2-7B's published shape (no download): hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000
LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)
#: Llama-3-8B's published shape: hidden 4096, 32 layers, 32 heads / 8 key-value heads, MLP 14336, vocab 128256
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
#: the published shapes ``--model`` names
SHAPES = {"llama-7b": LLAMA_7B, "llama3-8b": LLAMA3_8B}


def build_model(spec: str, seq: int):
    """A function building the model on the meta device (the estimate calls it there)."""
    if spec == "gpt":
        from composable_atorch.models import GPT, GPTConfig

        return lambda: GPT(GPTConfig(seq_len=seq))
    if spec in SHAPES or spec.startswith("hf:"):
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**SHAPES[spec]) if spec in SHAPES else AutoConfig.from_pretrained(spec[3:])
        # the model named on the command line: its modeling module is imported here, so a plan may
        # name its block class (a plan never imports a module itself)
        AutoModelForCausalLM._model_mapping[type(config)]
        return lambda: AutoModelForCausalLM.from_config(config)
    from composable_atorch.errors import ConfigError

    raise ConfigError("--model", spec, f"gpt, {', '.join(SHAPES)}, or hf:<path to a config.json>")


def degrees(plan_data: dict, world: int) -> dict[str, int]:
    """The plan's tensor and pipeline degrees (1 where it has none)."""
    from composable_atorch.auto.space import parallel_degree
    from composable_atorch.core.plan import Plan
    from composable_atorch.environment import Environment

    plan = Plan.from_dict(plan_data, env=Environment.detect().with_(world_size=world))
    return {dim: parallel_degree(plan, dim) for dim in ("tensor", "pipeline")}


def data_degree(plan_data: dict, world: int) -> int:
    """Ranks that split the batch: the world over the plan's tensor and pipeline degrees."""
    d = degrees(plan_data, world)
    return max(1, world // (d["tensor"] * d["pipeline"]))


def lm_criterion(output, targets):
    """Next-token cross-entropy on a model's logits (an HF output's ``.logits`` or a tensor)."""
    from composable_atorch.models.gpt import lm_loss

    return lm_loss(getattr(output, "logits", output), targets)


def main(argv: list[str]) -> int:
    from composable_atorch.estimate import estimate
    from composable_atorch.estimate.core import as_plan_dict
    from composable_atorch.estimate.result import human
    from composable_atorch.units import parse_bytes

    parser = argparse.ArgumentParser(
        prog="python -m composable_atorch estimate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan", help="a plan JSON file (plan.to_json(), best_plan.json)")
    parser.add_argument("--model", default="gpt", help="gpt | llama-7b | llama3-8b | hf:<config.json>")
    parser.add_argument("--batch", type=int, default=4, help="samples per data-parallel rank")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (tokens per sample)")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpu", default=None, help="accelerator to price on: a catalog name or a .json/.toml file")
    parser.add_argument("--nodes", type=int, default=None, help="machines the world spans (default: world / 8)")
    parser.add_argument("--device-memory", default=None, help="bytes per device, e.g. 80GiB (default: the --gpu's)")
    parser.add_argument("--margin", type=float, default=0.1, help="safety margin on the peak (fraction)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = parser.parse_args(argv)
    try:
        data = as_plan_dict(args.plan)
        build = build_model(args.model, args.seq)
        global_batch = args.batch * data_degree(data, args.world_size)
        shape = torch.Size([global_batch, args.seq])
        pipeline = degrees(data, args.world_size)["pipeline"] > 1
        # a pipeline trains on (inputs, targets) with the loss inside its schedule: next-token cross-entropy
        batch = (shape, shape) if args.model == "gpt" or pipeline else {"input_ids": shape, "labels": shape}
        est = estimate(
            data,
            build,
            batch,
            world_size=args.world_size,
            device=args.device,
            criterion=lm_criterion if pipeline else None,
            hardware=args.gpu,
            nodes=args.nodes,
        )
        limit = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else est.device_memory
    except CompositionError as exc:
        print(f"error: {exc}")
        return 2
    if args.json:
        print(json.dumps({**est.to_dict(), "fits": None if limit is None else est.fits(limit, args.margin)}, indent=2))
        return 0 if limit is None or est.fits(limit, args.margin) else 1
    else:
        print(f"{args.model}, {args.batch} x {args.seq} tokens per rank, world {args.world_size}")
        print(est.table())
        if limit is not None:
            ok = est.fits(limit, args.margin)
            print(
                f"{'fits' if ok else 'does NOT fit'} in {args.device_memory or human(limit)} per device "
                f"(peak + {args.margin:.0%} margin)"
            )
    return 0 if limit is None or est.fits(limit, args.margin) else 1

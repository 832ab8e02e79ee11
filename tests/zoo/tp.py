"""Tiny models for tensor parallelism beyond plain decoders, at width 32 (configs from
:mod:`zoo.configs`): a LoRA- / DoRA-wrapped Llama (peft), DeepSeek-V3 (latent attention, routed and
shared experts), Qwen2-MoE (3-D experts, a shared expert and its gate), ConvNeXt (pointwise ``Linear``
pairs on channels-last tensors), a user's own ConvNeXt-style CNN, ViT and CLIP (two towers).

    model = build(name)                    # seeded: the same weights on every call
    x, y = batch(name, seed)               # the global batch, the same on every rank
    loss = loss(name, model, x, y)
"""

from __future__ import annotations

import torch
from torch import nn

from zoo import configs
from zoo.configs import SEQ, VOCAB
from zoo.user import PointwiseBlock, PointwiseCNN  # noqa: F401 - the tensor-parallel tests' user CNN

__all__ = ["SEQ", "VOCAB", "PointwiseBlock", "PointwiseCNN"]

IMAGE, LABELS = 32, 4


def _llama():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(
        configs.cfg("LlamaConfig", **configs.shape(32, num_key_value_heads=2, max_position_embeddings=64))
    )


def lora_llama(dropout: float = 0.1):
    """peft LoRA on every projection (q/k/v/o, gate/up/down): column and row wrappers, dropout on."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # B nonzero: the adapters change the output from the first step
    return configs.lora(_llama(), targets, lora_dropout=dropout, init_lora_weights=False)


def dora_llama():
    """DoRA (a LoRA variant whose weight norm reads the whole weight) on q_proj: not split."""
    return configs.lora(_llama(), ["q_proj"], use_dora=True)


def deepseek_v3():
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(configs.deepseek_v3(32, moe=16, q_lora=16, v_head=8, max_position_embeddings=64))


def deepseek_v3_q():
    """DeepSeek-V3 at width 64, where ``q_b_proj`` writes the model's width: ``q_a_proj -> q_b_proj`` is traced
    as a pair, which fails at one rank's shapes (its q_a_layernorm and the rope split read the whole width)."""
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(configs.deepseek_v3(64, moe=32, q_lora=32, v_head=16, max_position_embeddings=64))


def _decoder(width: int = 32, **fields) -> dict:
    return configs.shape(width, num_key_value_heads=2, max_position_embeddings=64, **fields)


def olmo3():
    """OLMo-3: q_norm / k_norm over the whole q / k projection (not per head), sliding-window layers."""
    from transformers import Olmo3ForCausalLM

    return Olmo3ForCausalLM(configs.cfg("Olmo3Config", **_decoder()))


def lfm2():
    """LFM2: a short-convolution block (in_proj -> causal depthwise conv -> out_proj), then full attention."""
    from transformers import Lfm2ForCausalLM

    return Lfm2ForCausalLM(configs.cfg("Lfm2Config", **_decoder(), layer_types=["conv", "full_attention"]))


def qwen3_next():
    """Qwen3-Next: gated delta-rule linear attention (fused qkvz / ba projections, a short conv, a gated
    norm), then gated full attention; MoE with a gated shared expert."""
    from transformers import Qwen3NextForCausalLM

    linear = {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    }
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    return Qwen3NextForCausalLM(
        configs.cfg(
            "Qwen3NextConfig",
            **_decoder(head_dim=8, layer_types=["linear_attention", "full_attention"]),
            **linear,
            **experts,
            shared_expert_intermediate_size=32,
        )
    )


def qwen2_moe():
    from transformers import Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(configs.qwen2_moe(32, moe=16, shared=32, max_position_embeddings=64))


def convnext():
    from transformers import ConvNextForImageClassification

    return ConvNextForImageClassification(configs.convnext([16, 32], [1, 1], IMAGE, LABELS))


def vit():
    from transformers import ViTForImageClassification

    return ViTForImageClassification(configs.vit(32, IMAGE, 8, LABELS))


def clip():
    """A two-tower contrastive model: text and image encoders, trained on its own contrastive loss."""
    from transformers import CLIPModel

    return CLIPModel(configs.clip(32, IMAGE, 8, projection=16, positions=SEQ))


BUILDERS = {
    "lora_llama": lora_llama,
    "dora_llama": dora_llama,
    "deepseek_v3": deepseek_v3,
    "deepseek_v3_q": deepseek_v3_q,
    "olmo3": olmo3,
    "lfm2": lfm2,
    "qwen3_next": qwen3_next,
    "llama": _llama,
    "qwen2_moe": qwen2_moe,
    "convnext": convnext,
    "user_cnn": lambda: PointwiseCNN(labels=LABELS),
    "vit": vit,
    "clip": clip,
}
VISION = ("convnext", "user_cnn", "vit")


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]()


def batch(name: str, seed: int = 0, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + seed)
    if name == "clip":  # (token ids, images)
        return torch.randint(3, VOCAB, (size, SEQ), generator=g), torch.randn(size, 3, IMAGE, IMAGE, generator=g)
    if name in VISION:
        return torch.randn(size, 3, IMAGE, IMAGE, generator=g), torch.randint(0, LABELS, (size,), generator=g)
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    return ids, ids


def loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's training loss on one batch (CLIP: its contrastive loss on text and images)."""
    if name == "clip":
        return model(input_ids=x, pixel_values=y, return_loss=True).loss
    return loss_of(name, model(x), y)


def loss_of(name: str, out, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the logits (next-token for the language models, the label for images)."""
    logits = out.logits if hasattr(out, "logits") else out
    if name in VISION:
        return nn.functional.cross_entropy(logits.float(), y)
    return nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), y[:, 1:].flatten())

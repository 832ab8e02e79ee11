"""Tiny models for tensor parallelism beyond plain decoders, built as users build them (configs with
their defaults left on, ``use_cache`` included; no download): a LoRA-wrapped Llama (peft), DeepSeek-V3
(latent attention, routed and shared experts), Qwen2-MoE (3-D experts, a shared expert and its gate),
ConvNeXt (pointwise ``Linear`` pairs on channels-last tensors), a user's own ConvNeXt-style CNN, ViT and
CLIP (two towers: text and image).

    model = build(name)                    # seeded: the same weights on every call
    x, y = batch(name, seed)               # the global batch, the same on every rank
    loss = loss(name, model, x, y)
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, IMAGE, LABELS = 128, 16, 32, 4


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    return LlamaForCausalLM(cfg)


def lora_llama(dropout: float = 0.1):
    """peft LoRA on every projection (q/k/v/o, gate/up/down): column and row wrappers, dropout on."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # B nonzero: the adapters change the output from the first step
    )
    return get_peft_model(_llama(), cfg)


def dora_llama():
    """DoRA (a LoRA variant whose weight norm reads the whole weight) on q_proj: not split."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"]))


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    return DeepseekV3ForCausalLM(cfg)


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2MoeForCausalLM(cfg)


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=LABELS, image_size=IMAGE)
    return ConvNextForImageClassification(cfg)


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=IMAGE,
        patch_size=8,
        num_labels=LABELS,
    )
    return ViTForImageClassification(cfg)


def clip():
    """A two-tower contrastive model: text and image encoders, trained on its own contrastive loss."""
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE)
    return CLIPModel(CLIPConfig(text_config=text, vision_config={**vision, "patch_size": 8}, projection_dim=16))


class PointwiseBlock(nn.Module):
    """ConvNeXt's block as a user writes it: depthwise conv, then Linear(d, 4d) -> GELU -> Linear(4d, d)
    on channels-last activations, a residual around it."""

    def __init__(self, d: int):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.fc2(nn.functional.gelu(self.fc1(h))).permute(0, 3, 1, 2)


class UserCNN(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(PointwiseBlock(d), PointwiseBlock(d))
        self.head = nn.Linear(d, LABELS)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


BUILDERS = {
    "lora_llama": lora_llama,
    "dora_llama": dora_llama,
    "deepseek_v3": deepseek_v3,
    "qwen2_moe": qwen2_moe,
    "convnext": convnext,
    "user_cnn": UserCNN,
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

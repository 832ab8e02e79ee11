"""A zoo of tiny models as users bring them: Hugging Face architectures built from their configs
(no download) and a plain user-written ``nn.Module``, each with its batch and its loss.

    for name in ZOO:
        model = build(name)                  # seeded: the same weights on every call
        loss = zoo_loss(name, model, batch(name, seed=0))

``KIND[name]`` says what the architecture is (``"decoder"``: a causal LM; ``"encoder"``: masked LM;
``"seq2seq"``: encoder-decoder; ``"plain"``: the user model), which decides which transforms have a
meaning for it (a pipeline cut needs a decoder-only or plain chain model). ``WIDE`` is the widened
zoo (issue 27), each ``KIND`` a sentence saying what the family is; its batches are token ids or a
dict (images, labels), cut into a rank's rows by ``part``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
SEQ = 16

#: a small common shape: 2 layers, hidden 64, 4 heads (2 key/value heads where the family has GQA)
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _cfg(cls_name: str, **fields):
    """The family's config with its defaults left on, as users build it (``use_cache`` included: a
    model then builds a key/value cache in every training forward, which transforms must handle)."""
    import transformers

    # the families' default special tokens lie outside the tiny vocabulary
    return getattr(transformers, cls_name)(**{"bos_token_id": 1, "eos_token_id": 2, **fields})


def _causal(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg)


CONFIGS = {
    "llama": lambda: _cfg("LlamaConfig", **_DECODER, num_key_value_heads=2),
    "mistral": lambda: _cfg("MistralConfig", **_DECODER, num_key_value_heads=2, sliding_window=None),
    "qwen2": lambda: _cfg("Qwen2Config", **_DECODER, num_key_value_heads=2),
    "qwen3": lambda: _cfg("Qwen3Config", **_DECODER, num_key_value_heads=2, head_dim=16),
    "gemma": lambda: _cfg("GemmaConfig", **_DECODER, num_key_value_heads=2, head_dim=16),
    "granite": lambda: _cfg("GraniteConfig", **_DECODER, num_key_value_heads=2),
    "olmo": lambda: _cfg("OlmoConfig", **_DECODER, num_key_value_heads=2),
    "stablelm": lambda: _cfg("StableLmConfig", **_DECODER, num_key_value_heads=2),
    "starcoder2": lambda: _cfg("Starcoder2Config", **_DECODER, num_key_value_heads=2),
    "phi": lambda: _cfg("PhiConfig", **_DECODER),
    "phi3": lambda: _cfg("Phi3Config", **_DECODER, num_key_value_heads=2, pad_token_id=0),
    "mixtral": lambda: _cfg(
        "MixtralConfig", **_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "gpt2": lambda: _cfg("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": lambda: _cfg(
        "GPTNeoXConfig", **_DECODER, max_position_embeddings=64, use_parallel_residual=True, rotary_pct=0.5
    ),
    "opt": lambda: _cfg(
        "OPTConfig",
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=64,
    ),
    "bloom": lambda: _cfg("BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "falcon": lambda: _cfg(
        "FalconConfig",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=True,
    ),
    "gptj": lambda: _cfg("GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64),
    "bert": lambda: _cfg(
        "BertConfig",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    ),
    "t5": lambda: _cfg(
        "T5Config",
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
}

KIND = {name: "decoder" for name in CONFIGS}
KIND.update(bert="encoder", t5="seq2seq", user="plain")

#: image side and classes of the vision families' batches
IMG, CLASSES = 16, 10
_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
_TEXT = dict(_VIT, vocab_size=VOCAB, max_position_embeddings=32)

#: the widened zoo (issue 27): name -> its config (the families in ``CONFIGS`` are the first round)
WIDE_CONFIGS = {
    "vit": lambda: _cfg("ViTConfig", **_VIT, image_size=IMG, patch_size=4, num_labels=CLASSES),
    "clip": lambda: _cfg(
        "CLIPConfig",
        text_config=dict(_TEXT, bos_token_id=1, eos_token_id=2),
        vision_config=dict(_VIT, image_size=IMG, patch_size=4),
        projection_dim=32,
    ),
    "mamba": lambda: _cfg(
        "MambaConfig", vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    ),
    "qwen2_moe": lambda: _cfg(
        "Qwen2MoeConfig",
        **_DECODER,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "deepseek_v3": lambda: _cfg(
        "DeepseekV3Config",
        **_DECODER,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    # a window shorter than the batch's sequence: the sliding layers really mask differently
    "gemma2": lambda: _cfg("Gemma2Config", **_DECODER, num_key_value_heads=2, head_dim=16, sliding_window=8),
    "gpt_oss": lambda: _cfg(
        "GptOssConfig",
        **_DECODER,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "lora_llama": lambda: CONFIGS["llama"](),
    "deberta_v2": lambda: _cfg(
        "DebertaV2Config",
        **_TEXT,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        pad_token_id=0,
    ),
    "convnext": lambda: _cfg(
        "ConvNextConfig",
        num_channels=3,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[2, 2],
        image_size=IMG,
        num_labels=CLASSES,
    ),
}
KIND.update(
    vit="vision encoder (ViT): patches through a bidirectional encoder, a classification head",
    clip="contrastive two-tower (CLIP): a text and a vision encoder, a loss over the batch's pairs",
    mamba="state-space decoder (Mamba): selective scan blocks, a state cache",
    qwen2_moe="decoder, mixture of experts with a gated shared expert (Qwen2-MoE)",
    deepseek_v3="decoder, latent attention (low-rank q / kv) and MoE with shared experts (DeepSeek-V3)",
    gemma2="decoder, alternating sliding-window / full attention by layer index (Gemma 2)",
    gpt_oss="decoder, alternating sliding / full attention, attention sinks and MoE (GPT-OSS)",
    lora_llama="decoder wrapped by peft: LoRA adapters on q/v, base weights frozen (PeftModel)",
    deberta_v2="encoder-only masked LM with disentangled relative-position attention (DeBERTa-v2)",
    convnext="vision CNN (ConvNeXt): depthwise convs, pointwise Linear pairs, layer scale",
    cnn="plain user CNN: a conv stem, an nn.ModuleList of residual conv blocks, a linear head",
)


class UserBlock(nn.Module):
    """A block as a user writes one: pre-norm attention (SDPA) and an MLP, no library conventions."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class UserModel(nn.Module):
    """A plain user model: embedding, an ``nn.ModuleList`` of blocks, a norm and a head."""

    def __init__(self, vocab: int = VOCAB, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(UserBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class ConvBlock(nn.Module):
    """A residual conv block as a user writes one (GroupNorm: no batch statistics between ranks)."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(4, c)

    def forward(self, x):
        return x + self.conv2(nn.functional.gelu(self.norm(self.conv1(x))))


class UserCNN(nn.Module):
    """A plain user CNN: a conv stem, residual conv blocks in an ``nn.ModuleList``, pooling, a head."""

    def __init__(self, c: int = 16, layers: int = 2, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(c) for _ in range(layers))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


ZOO = (*CONFIGS, "user")
#: the widened zoo: families of 2026 not in the first round (vision, two-tower, state-space, MoE with
#: shared experts / latent attention, hybrid sliding attention, LoRA, DeBERTa, CNNs)
WIDE = (*WIDE_CONFIGS, "cnn")
#: families whose loss couples a batch's samples (CLIP's contrastive loss): data parallelism trains
#: each rank's part as its own batch (no all-gather of features), so one process's reference takes
#: the mean of the parts' losses
COUPLED = ("clip",)


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny model ``name`` with weights fixed by ``seed`` (eager attention left to each family's default)."""
    torch.manual_seed(seed)
    if name == "user":
        return UserModel()
    if name == "cnn":
        return UserCNN()
    if name in WIDE_CONFIGS:
        return _build_wide(name, WIDE_CONFIGS[name]())
    cfg = CONFIGS[name]()
    if KIND[name] == "encoder":
        from transformers import BertForMaskedLM

        return BertForMaskedLM(cfg)
    if KIND[name] == "seq2seq":
        from transformers import T5ForConditionalGeneration

        return T5ForConditionalGeneration(cfg)
    return _causal(cfg)


def _build_wide(name: str, cfg) -> nn.Module:
    import transformers as tf

    if name == "lora_llama":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = get_peft_model(tf.LlamaForCausalLM(cfg), lora)
        for module in model.modules():  # LoRA's B starts at zero: give the adapters a gradient on A too
            if hasattr(module, "lora_B"):
                for linear in module.lora_B.values():
                    nn.init.normal_(linear.weight, std=0.02)
        return model
    heads = {
        "vit": tf.ViTForImageClassification,
        "clip": tf.CLIPModel,
        "deberta_v2": tf.DebertaV2ForMaskedLM,
        "convnext": tf.ConvNextForImageClassification,
    }
    return heads[name](cfg) if name in heads else _causal(cfg)


def _images(name: str) -> bool:
    return name in ("vit", "convnext", "cnn")


def batch(name: str, seed: int = 0, size: int = 4):
    """A global batch (the same on every rank for the same seed): token ids for the language
    families, ``{"pixel_values", "labels"}`` for the vision ones, ids and images for CLIP."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    if _images(name) or name == "clip":
        pixels = torch.randn(size, 3, IMG, IMG, generator=g)
        if name == "clip":
            return {"input_ids": ids, "pixel_values": pixels}
        return {"pixel_values": pixels, "labels": torch.randint(0, CLASSES, (size,), generator=g)}
    return ids


def part(data, rows):
    """The rows ``rows`` (a slice) of a batch, whatever its form."""
    return {k: v[rows] for k, v in data.items()} if isinstance(data, dict) else data[rows]


def zoo_loss(name: str, model: nn.Module, ids) -> torch.Tensor:
    """The family's training loss on a batch (language families: labels are the inputs)."""
    if name == "user":
        logits = model(ids)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    if name == "cnn":
        return nn.functional.cross_entropy(model(ids["pixel_values"]).float(), ids["labels"])
    if _images(name):
        return model(**ids).loss
    if name == "clip":
        return model(**ids, return_loss=True).loss
    out = model(input_ids=ids, labels=ids)
    return out.loss

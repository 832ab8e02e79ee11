"""The tests' tiny models, in one place: Hugging Face architectures built from their configs (no
download) and plain user-written ``nn.Module``s, each with its batch and its loss.

    import zoo                           # the cross-transform zoo (this module)
    from zoo import pipeline, tp         # the pipeline / tensor-parallel tests' extra models
    from zoo import moe                  # the mixture-of-experts families

Modules: :mod:`zoo.configs` (every family's config, once, sized by the caller), :mod:`zoo.user`
(the hand-written models), :mod:`zoo.pipeline`, :mod:`zoo.tp`.

The zoo itself:

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

from zoo.configs import SEQ, VOCAB, attention, cfg, shape
from zoo.configs import clip as _clip
from zoo.configs import convnext as _convnext
from zoo.configs import deepseek_v3 as _deepseek_v3
from zoo.configs import qwen2_moe as _qwen2_moe
from zoo.configs import vit as _vit
from zoo.user import CLASSES, ConvBlock, UserBlock, UserCNN, UserModel  # noqa: F401 - the zoo's user models

__all__ = ["SEQ", "VOCAB", "CLASSES", "ConvBlock", "UserBlock", "UserCNN", "UserModel"]

#: a small common shape: 2 layers, hidden 64, 4 heads (2 key/value heads where the family has GQA)
_DECODER = shape(64)
_GQA = shape(64, num_key_value_heads=2)


def _causal(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


CONFIGS = {
    "llama": lambda: cfg("LlamaConfig", **_GQA),
    "mistral": lambda: cfg("MistralConfig", **_GQA, sliding_window=None),
    "qwen2": lambda: cfg("Qwen2Config", **_GQA),
    "qwen3": lambda: cfg("Qwen3Config", **_GQA, head_dim=16),
    "gemma": lambda: cfg("GemmaConfig", **_GQA, head_dim=16),
    "granite": lambda: cfg("GraniteConfig", **_GQA),
    "olmo": lambda: cfg("OlmoConfig", **_GQA),
    "stablelm": lambda: cfg("StableLmConfig", **_GQA),
    "starcoder2": lambda: cfg("Starcoder2Config", **_GQA),
    "phi": lambda: cfg("PhiConfig", **_DECODER),
    "phi3": lambda: cfg("Phi3Config", **_GQA, pad_token_id=0),
    "mixtral": lambda: cfg("MixtralConfig", **_GQA, num_local_experts=4, num_experts_per_tok=2),
    "gpt2": lambda: cfg("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": lambda: cfg(
        "GPTNeoXConfig", **_DECODER, max_position_embeddings=64, use_parallel_residual=True, rotary_pct=0.5
    ),
    "opt": lambda: cfg("OPTConfig", **attention(64), ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=64),
    "bloom": lambda: cfg("BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "falcon": lambda: cfg("FalconConfig", **attention(64), new_decoder_architecture=False, multi_query=True),
    "gptj": lambda: cfg("GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64),
    "bert": lambda: cfg("BertConfig", **_DECODER, max_position_embeddings=64),
    "t5": lambda: cfg(
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

#: image side of the vision families' batches
IMG = 16

#: the widened zoo (issue 27): name -> its config (the families in ``CONFIGS`` are the first round)
WIDE_CONFIGS = {
    "vit": lambda: _vit(64, IMG, 4, CLASSES),
    "clip": lambda: _clip(64, IMG, 4, projection=32, positions=32),
    "mamba": lambda: cfg(
        "MambaConfig", vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    ),
    "qwen2_moe": lambda: _qwen2_moe(64, moe=32, shared=64),
    "deepseek_v3": lambda: _deepseek_v3(64, moe=32, q_lora=32, v_head=16),
    # a window shorter than the batch's sequence: the sliding layers really mask differently
    "gemma2": lambda: cfg("Gemma2Config", **_GQA, head_dim=16, sliding_window=8),
    "gpt_oss": lambda: cfg(
        "GptOssConfig", **_GQA, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2
    ),
    "lora_llama": lambda: CONFIGS["llama"](),
    "deberta_v2": lambda: cfg(
        "DebertaV2Config",
        **shape(64, max_position_embeddings=32),
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        pad_token_id=0,
    ),
    "convnext": lambda: _convnext([16, 32], [2, 2], IMG, CLASSES),
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
    config = CONFIGS[name]()
    if KIND[name] == "encoder":
        from transformers import BertForMaskedLM

        return BertForMaskedLM(config)
    if KIND[name] == "seq2seq":
        from transformers import T5ForConditionalGeneration

        return T5ForConditionalGeneration(config)
    return _causal(config)


def _build_wide(name: str, config) -> nn.Module:
    import transformers as tf

    from zoo.configs import lora

    if name == "lora_llama":
        model = lora(tf.LlamaForCausalLM(config), ["q_proj", "v_proj"], lora_dropout=0.0)
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
    return heads[name](config) if name in heads else _causal(config)


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

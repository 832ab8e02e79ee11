"""A guessed example input for a model, built from its structure alone (no data, no tokenizer).

Several transforms run a model once before training to learn its shape: ddp's probe finds the
parameters that get no gradient, the tensor-parallel planner traces which projections feed which.
They must agree on what the model takes, so the guess lives here, once:

- a transformers model by its ``main_input_name``: token ids for a language model (and decoder ids
  for an encoder-decoder), an image at the config's ``image_size`` / ``num_channels`` for a vision
  model (``pixel_values``: ViT, ConvNeXt), ids and an image for a two-tower model (CLIP);
- a plain ``nn.Module`` by its first layer: an Embedding takes ids, a Conv2d an image, a Linear
  features.

None when no guess is possible (the caller then says the model was not probed).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

#: tokens in a guessed text input; side of a guessed image when the model does not say its size
TOKENS, IMAGE_SIDE = 8, 32


def is_conv1d(m) -> bool:
    """GPT-2's ``Conv1D`` (a Linear with its weight stored ``[in, out]``)."""
    return (
        type(m).__name__ == "Conv1D"
        and hasattr(m, "nf")
        and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2
    )


def is_linear(m) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def features(m) -> tuple[int, int]:
    """``(in, out)`` of a Linear or Conv1D."""
    return (m.weight.shape[0], m.weight.shape[1]) if is_conv1d(m) else (m.in_features, m.out_features)


def example_input(model: nn.Module) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of one small forward the model accepts (batch 1), or None."""
    cfg = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if cfg is not None and main == "pixel_values":
        return (), {"pixel_values": pixels(cfg)}
    if cfg is not None and main is not None:
        ids = _ids(int(getattr(cfg, "vocab_size", 2) or 2))
        kwargs = {main: ids}
        if getattr(cfg, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        vision = getattr(cfg, "vision_config", None)
        if vision is not None and "pixel_values" in inspect.signature(model.forward).parameters:
            kwargs["pixel_values"] = pixels(vision)  # a two-tower model (CLIP) takes text and an image
        return (), kwargs
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Conv2d) or is_linear(m)), None)
    if isinstance(first, nn.Embedding):
        return (torch.arange(TOKENS).remainder(first.num_embeddings).unsqueeze(0),), {}
    if isinstance(first, nn.Conv2d):
        return (torch.zeros(1, first.in_channels, IMAGE_SIDE, IMAGE_SIDE, dtype=first.weight.dtype),), {}
    if first is not None:
        return (torch.zeros(1, TOKENS, features(first)[0], dtype=first.weight.dtype),), {}
    return None


def pixels(cfg) -> torch.Tensor:
    """One zero image of the config's size (``image_size`` an int or a pair; 32 when not given)."""
    size = getattr(cfg, "image_size", None) or IMAGE_SIDE
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return torch.zeros(1, int(getattr(cfg, "num_channels", 3) or 3), int(h), int(w))


def _ids(vocab: int) -> torch.Tensor:
    """``TOKENS`` ids from 1 up (0 is often padding), wrapping below ``vocab``."""
    return torch.arange(TOKENS).remainder(max(vocab - 1, 1)).add(1).unsqueeze(0)

"""Save a model trained under any plan as a Hugging Face model directory.

    save_pretrained(model, "out/final")            # every rank calls it; rank 0 writes
    AutoModelForCausalLM.from_pretrained("out/final")   # or PeftModel.from_pretrained(base, ...)

The full weights are gathered once, to CPU, on rank 0
(``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict=True,
cpu_offload=True``): FSDP2's DTensor shards, DDP's replicas, ZeRO's partitions and plain modules
alike; expert-parallel experts are all-gathered over their expert group into the whole ``[E, ...]``
tensors (each rank holds its own experts under the full names). Then

* a ``transformers`` model is written by its own ``save_pretrained`` (``config.json``,
  ``generation_config.json`` when it has one, ``model.safetensors``);
* a ``peft`` model writes its adapter alone (``adapter_config.json``,
  ``adapter_model.safetensors``) - the frozen base is the one you started from;
* any other module writes ``model.safetensors`` (shared tensors stored once).

This is Accelerate's "save" step (``accelerator.unwrap_model(model).save_pretrained(...)``) with the
config and the adapter-only case handled. For resuming a run use :func:`save_state` (sharded,
with the optimizer); this is the artefact you ship.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from composable_atorch.errors import ConfigError, RequirementError
from composable_atorch.runtime.optim import NAME_PREFIX_ATTR, canonical_name
from composable_atorch.transforms.parallel.expert import checkpoint as expert_checkpoint

__all__ = ["full_state_dict", "save_pretrained", "unwrap_model"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under a whole-model wrapper (DeepSpeed's engine, fairscale's ShardedDDP).

    FSDP2, ``replicate`` (ddp), the composable checkpoint and per-block compile act in place, so
    for them this is ``model`` itself.
    """
    seen = 0
    while (
        getattr(model, NAME_PREFIX_ATTR, "")
        and isinstance(getattr(model, "module", None), torch.nn.Module)
        and seen < 8
    ):
        model, seen = model.module, seen + 1
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU on rank 0 (an empty dict on other ranks). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    expert_checkpoint.gather_whole(model, state)  # expert parallelism: every rank's experts, not rank 0's
    prefix = getattr(model, NAME_PREFIX_ATTR, "")
    return {canonical_name(k.removeprefix(prefix)): v for k, v in state.items()}


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _is_transformers(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def save_pretrained(model: torch.nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``model`` (trained under any plan) to ``directory`` as Hugging Face does; returns it.

    Call on every rank (the gather is collective); only rank 0 writes. See the module doc.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module (the model a plan returned)")
    out = Path(directory)
    state = full_state_dict(model)
    inner = unwrap_model(model)
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        if _is_peft(inner):
            # peft picks the adapter's tensors out of the full state dict itself
            inner.save_pretrained(str(out), state_dict=state, safe_serialization=True)
        elif _is_transformers(inner):
            inner.save_pretrained(str(out), state_dict=state)
        else:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise RequirementError(
                    "save_pretrained", "the safetensors package", 'pip install "composable_atorch[hf]"'
                ) from None
            save_file(_dedupe(state), str(out / "model.safetensors"), metadata={"format": "pt"})
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def _dedupe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied weights): keep the first name of each, contiguous."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = t.detach().contiguous()
    return out

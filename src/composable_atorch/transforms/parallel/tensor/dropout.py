"""Dropout random streams under tensor parallelism: ATorch's ``replic_drop`` / ``parallel_drop``.

torch's own answer for DTensor random ops, ``torch.distributed.tensor._random.OffsetBasedRNGTracker``,
moves a Philox offset so each shard draws its part of one global random tensor; it refuses the
CPU ("requires the presence of CUDA/CUDA-like/XPU device": the CPU generator is a Mersenne Twister
with no offsets to move). So the streams are kept here, the way Megatron's RNG tracker does:

* every tensor rank of a group starts from the same default RNG state (:func:`sync_rng`, the
  broadcast DTensor's tracker does with ``run_state_sync``). A ``replic_drop`` module sees the same
  replicated activation on every tensor rank, so it draws the same mask everywhere — the mask one
  process draws with that seed;
* under ``sequence_parallel`` a ``replic_drop`` module inside the blocks sees a sequence shard:
  it draws the full mask from the shared stream (as one process does, ``bernoulli_`` then scale,
  ATen's CPU dropout) and keeps its own slice of it (:func:`sequence_sliced`);
* a ``parallel_drop`` module (its activation is sharded: attention heads) runs on a per-rank
  stream (:func:`per_rank`): a seed is drawn from the shared stream (so every rank's shared stream
  advances alike and activation checkpointing, which restores that stream for the recompute,
  redraws the same masks) and mixed with the tensor rank.

One process draws a ``parallel_drop`` mask from the shared stream, the per-rank stream cannot:
losses equal one process with the same seed when every ``parallel_drop`` module has ``p == 0``
(``replic_drop`` modules may drop). An HF attention that reads ``attn_dropout.p`` and drops inside
its kernel (sdpa / eager in transformers 5) never calls the module; :func:`per_rank` warns once
when that happens in training, since that dropout then draws the shared stream on every rank.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.distributed as dist
from torch import nn

#: Megatron's offset between the shared seed and the model-parallel one, kept for familiarity.
_PARALLEL_OFFSET = 2718


def sync_rng(group) -> None:
    """Every rank of ``group`` takes its first rank's CPU RNG state."""
    state = torch.get_rng_state()
    dist.broadcast(state, group=group, group_src=0)
    torch.set_rng_state(state)


def _drops(module: nn.Module) -> bool:
    p = getattr(module, "p", None)
    return module.training and (p is None or p > 0)


def per_rank(module: nn.Module, parent: nn.Module | None, rank: int) -> None:
    """Run ``module``'s forward on a stream that differs per tensor rank (see the module docstring)."""
    original = module.forward
    seen = {"called": False, "warned": False}

    def forward(self, *args, **kwargs):
        seen["called"] = True
        if not _drops(self):
            return original(*args, **kwargs)
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((seed + _PARALLEL_OFFSET * (rank + 1)) % 2**63)
            return original(*args, **kwargs)

    module.forward = types.MethodType(forward, module)
    if parent is None:
        return

    def before(_m, _args):
        seen["called"] = False

    def after(_m, _args, _out):
        if parent.training and _drops(module) and not seen["called"] and not seen["warned"]:
            seen["warned"] = True
            warnings.warn(
                f"parallel_drop module {type(module).__name__}(p={getattr(module, 'p', '?')}) was not called by its "
                "parent "
                f"{type(parent).__name__}: the parent drops inside its attention kernel from the shared stream, so "
                "every "
                "tensor rank draws the same mask for its own heads. Use an attention that calls the module (HF GPT-2: "
                "reorder_and_upcast_attn=True with attn_implementation='eager') or set the attention dropout to 0.",
                stacklevel=2,
            )

    parent.register_forward_pre_hook(before)
    parent.register_forward_hook(after)


def sequence_sliced(module: nn.Module, degree: int, rank: int, sequence: dict) -> None:
    """A replic_drop ``nn.Dropout`` seeing a sequence shard draws the full mask and keeps its slice.

    ``sequence["length"]`` is the full sequence length, recorded where the residual stream is
    split (see ``tensor._sequence_entry_exit``); inputs that are not a shard of it drop as usual.
    """
    original = module.forward

    def forward(self, x):
        full = sequence.get("length")
        if not _drops(self) or full is None or x.dim() < 2 or x.size(1) * degree != full:
            return original(x)
        shape = list(x.shape)
        shape[1] = full
        keep = 1 - self.p
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep).div_(keep)
        return x * noise.narrow(1, rank * x.size(1), x.size(1))

    module.forward = types.MethodType(forward, module)

"""``atorch.auto.opt_lib.ds_3d_parallel_optimization``: ATorch's config, with ATorch's logits.

The library's own default, with a vocabulary-parallel embedding, gathers the logits over the tensor
group, so any loss sees the whole vocabulary. ATorch's stops before the gather: each tensor rank
gets its vocabulary slice, and ATorch's scripts pair it with ``vocab_parallel_cross_entropy``
(ATorch's Llama2 3-D example does). Under this namespace the default is ATorch's, so such a loss
reads the slices it expects; pass ``logit_helper=`` to choose.
"""

from __future__ import annotations

from torch.nn import functional as F

from composable_atorch.transforms.parallel.ds3d import DeepSpeed3DParallelConfig as _LibraryConfig
from composable_atorch.transforms.parallel.ds3d.build import default_logit_helper
from composable_atorch.transforms.parallel.ds3d.tp import VocabParallelEmbedding, copy_to_group


def vocab_parallel_logit_helper(embed, lm_output):
    """ATorch's: this tensor rank's slice of the logits, ``[..., vocab / tensor]`` (no gather); the
    hidden states are copied to the group so their gradient is summed over the slices."""
    if not isinstance(embed, VocabParallelEmbedding):
        return default_logit_helper(embed, lm_output)
    hidden = lm_output[0] if isinstance(lm_output, tuple) else lm_output
    return F.linear(copy_to_group(hidden, embed.group), embed.weight)


class DeepSpeed3DParallelConfig(_LibraryConfig):
    """ATorch's ``DeepSpeed3DParallelConfig`` (names and defaults verbatim); with a vocabulary-parallel
    TPInfo and no ``logit_helper`` the logits stay sliced over the tensor ranks, as ATorch's."""

    def __init__(
        self,
        base_seed=1234,
        tpinfo=None,
        custom_patcher=None,
        tie_first=True,
        logit_helper=None,
        ds_config=None,
        batch_fn=None,
    ):
        super().__init__(base_seed, tpinfo, custom_patcher, tie_first, logit_helper, ds_config, batch_fn)
        if logit_helper is None and getattr(self.tpinfo, "is_vocab_parallelled", False):
            self.logit_helper = vocab_parallel_logit_helper


__all__ = ["DeepSpeed3DParallelConfig", "vocab_parallel_logit_helper"]

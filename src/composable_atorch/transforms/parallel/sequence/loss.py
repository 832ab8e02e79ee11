"""The loss over the whole sequence when ranks hold parts of it: sum of token losses over count of tokens.

Each rank's token mean is exact only when every part counts the same tokens. Targets padded with
``ignore_index`` can leave one part with fewer: :func:`sequence_cross_entropy` returns
``n x (this part's summed token losses) / (tokens counted over the group)``, whose mean over the
group (what the gradient sync and train_step's reported loss take) is the whole sequence's mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: attribute the split model carries: its :class:`~.attention.Attend` (group and size)
SPLIT_ATTR = "_composable_sequence_split"


def sequence_cross_entropy(model: torch.nn.Module, ignore_index: int = -100):
    """``loss_fn(output, targets)`` for ``train_step``: next-token cross-entropy over the whole sequence.

    ``output`` is logits or a transformers output with ``.logits``; ``targets`` are this rank's part
    (already shifted, as the loader gives them). Without a split it is the plain token mean.
    """

    def loss_fn(output, targets):
        logits = getattr(output, "logits", output)
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )
        count = (targets != ignore_index).sum().to(total.dtype)
        split = getattr(model, SPLIT_ATTR, None)
        if split is None or split.n == 1:
            return total / count.clamp(min=1)
        dist.all_reduce(count, group=split.group)
        return total * split.n / count.clamp(min=1)

    return loss_fn

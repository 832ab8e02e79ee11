"""``atorch.modules.distributed_modules.cross_entropy``: Megatron's vocabulary-parallel cross entropy.

Each rank of the tensor group holds the logits of its slice of the vocabulary (``[..., vocab / t]``,
rank ``r`` holding ids ``r * vocab / t`` onwards, as a vocab-parallel embedding / column-sharded
lm_head leaves them). The loss per token is ``log(sum over the vocabulary of exp(logit)) -
logit[target]``, computed with three all-reduces over the tensor group (max, target logit, sum of
exps) so the full logits are never gathered. Without a tensor dimension in the groups (or in one
process) it is plain cross entropy over the local logits. Returns the per-token losses (no
reduction), as ATorch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from composable_atorch.compat.atorch.distributed.distributed import parallel_group, parallel_rank
from composable_atorch.errors import ConfigError


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, tp_rank):
        logits = logits.float()
        logits_max = logits.max(dim=-1)[0]
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)
        part = logits.size(-1)
        start = tp_rank * part
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        softmax = exp / sum_exp.unsqueeze(-1)
        vocab = part * (dist.get_world_size(group) if group is not None else 1)
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab / (vocab - 1)
            mean_log_probs = (logits - sum_exp.log().unsqueeze(-1)).sum(dim=-1)
            if group is not None:
                dist.all_reduce(mean_log_probs, group=group)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs / vocab
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab / (ctx.vocab - 1)
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - smoothing) * hit)
            grad -= smoothing / ctx.vocab
        else:
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        return grad * grad_output.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token cross entropy of logits split over the tensor group's vocabulary slices."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError("vocab_parallel_cross_entropy label_smoothing", label_smoothing, "a value in [0, 1)")
    group = parallel_group("tensor")
    tp_rank = parallel_rank("tensor") or 0
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    out = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), group, tp_rank)
    return out.to(vocab_parallel_logits.dtype) if vocab_parallel_logits.is_floating_point() else out


__all__ = ["vocab_parallel_cross_entropy"]

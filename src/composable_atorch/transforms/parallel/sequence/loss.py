"""The loss over the whole sequence when ranks hold parts of it, and the checks that a user's loss
trains a split as one process does.

Each rank's loss is computed on its part of every sequence and the gradient sync averages over the
group, so a split trains as one process exactly when the loss is a mean of per-token terms over
equal numbers of tokens. :func:`sequence_cross_entropy` is such a mean also when targets padded with
``ignore_index`` leave the parts unequal: ``n x (this part's summed token losses) / (tokens counted
over the group)``, whose mean over the group is the whole sequence's mean.

A loss that shifts the targets inside itself (``out[:, :-1]`` against ``y[:, 1:]``, transformers'
habit with ``labels=input_ids``) pairs, on a part, the last token of one chunk with the first of
another and drops a real target; a per-sequence maximum or a weight of the sequence length is not a
sum of per-token terms. Both train silently wrong, so each is refused before the first step
(:class:`~composable_atorch.errors.SequenceLossError`), by what the library sees of the loss:

* ``train_step`` sees ``loss_fn``: :func:`check_loss` computes it on a short probe (the first
  forward's output layout, random values) over the whole probe and over each rank's part, and the
  parts' mean must equal the whole's;
* every backward through the plan's optimizer (``optim.backward``, ``wrap_loss``, ATorch's wrapped
  ``loss_func``) shows the loss's autograd graph: :class:`SequenceLossGuard` refuses a loss that
  slices, selects or rolls the model's output along its sequence dimension;
* a plain ``loss.backward()`` shows nothing: the guard then refuses batches whose targets equal
  their inputs token for token (a next-token loss on them can only shift inside itself).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from composable_atorch.errors import SequenceLossError
from composable_atorch.runtime.optim import OptimizerHook
from composable_atorch.runtime.sequence import is_probing, probing
from composable_atorch.transforms.parallel.sequence.shard import SHIFT_IN_DATA, DataSignals, chunk_positions

#: attribute the split model carries: its :class:`~.attention.Attend` (group and size)
SPLIT_ATTR = "_composable_sequence_split"
#: tokens per chunk of :func:`check_loss`'s probe (2n chunks: a shift inside changes 2n - 1 pairs)
PROBE_TOKENS = 4
#: the random probe outputs' scale: token losses that differ by O(1), so a pair mispaired moves the mean
SPREAD = 2.0
#: the peaked probe output: every odd position's first feature (class 0, which no probe target is);
#: a cross-entropy then costs ~log(classes) at even positions and ~PEAK at odd ones, whatever the
#: target, so a loss that leaves one position out (a shift inside) moves the mean by a fixed amount
PEAK = 20.0
#: the probe outputs :func:`check_loss` tries: peaked, and random with two seeds
VARIANTS = ("peaked", 1, 2)
#: relative difference of the whole probe's loss and the parts' mean that counts as a mismatch
RTOL = 1e-4


def sequence_cross_entropy(model: torch.nn.Module, ignore_index: int = -100):
    """``loss_fn(output, targets)`` for ``train_step``: next-token cross-entropy over the whole sequence.

    ``output`` is logits or a transformers output with ``.logits``; ``targets`` are this rank's part
    (already shifted, as the loader gives them). Without a split (or in a probe that runs the model
    as one process) it is the plain token mean.
    """

    def loss_fn(output, targets):
        logits = getattr(output, "logits", output)
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )
        count = (targets != ignore_index).sum().to(total.dtype)
        split = getattr(model, SPLIT_ATTR, None)
        if split is None or split.n == 1 or is_probing():
            return total / count.clamp(min=1)
        dist.all_reduce(count, group=split.group)
        return total * split.n / count.clamp(min=1)

    return loss_fn


# -- train_step's probe of loss_fn ---------------------------------------------------------------


def _map(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (a transformers output keeps its class)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        mapped = {k: _map(v, fn) for k, v in obj.items()}
        return type(obj)(**mapped) if hasattr(obj, "to_tuple") else type(obj)(mapped)
    if isinstance(obj, list | tuple):
        parts = [_map(v, fn) for v in obj]
        return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
    return obj


def _per_token(t: torch.Tensor, shape: tuple) -> bool:
    return t.dim() >= 2 and tuple(t.shape[:2]) == shape


def _probe_output(output, shape: tuple, length: int, group, variant):
    """The whole probe's output: the real output's layout with every per-token floating tensor one
    sequence of ``length`` in fp32: ``"peaked"`` (:data:`PEAK`), random (a seed), or (None) the real
    values of its first row repeated and broadcast from the group's first rank (values the loss's
    domain accepts, where the others give no finite loss)."""
    generator = torch.Generator().manual_seed(1234 + (variant if isinstance(variant, int) else 0))

    def whole(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_floating_point() and _per_token(t, shape)):
            return t
        size = (1, length, *t.shape[2:])
        if variant == "peaked":
            probe = torch.zeros(size)
            probe[:, 1::2, ..., 0] = PEAK
            return probe.to(t.device)
        if variant is not None:
            return (torch.randn(size, generator=generator) * SPREAD).to(t.device)
        index = torch.arange(length, device=t.device) % shape[1]
        probe = t.detach()[:1].index_select(1, index).float().contiguous()
        dist.broadcast(probe, group=group, group_src=0)
        return probe

    return _map(output, whole)


def _probe_targets(targets: torch.Tensor, shape: tuple, length: int, classes: int, group) -> torch.Tensor:
    """Targets built like the real ones: same dtype, one sequence of ``length`` where they are per token;
    class indices below ``classes``; where any rank's real targets hold a negative ignore_index, the
    probe's last quarter holds it too (all in one rank's part, so the parts count unequal tokens)."""
    per_token = _per_token(targets, shape)
    size = (1, length, *targets.shape[2:]) if per_token else (1, *targets.shape[1:])
    generator = torch.Generator().manual_seed(4321)
    if targets.is_floating_point():
        return torch.randn(size, generator=generator).to(targets.device, targets.dtype)
    probe = torch.randint(1, max(classes, 2), size, generator=generator)
    low = targets.detach().min().reshape(1).long() if targets.numel() else targets.new_zeros(1, dtype=torch.long)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    if per_token and int(low) < 0:
        probe[:, length - length // 4 :] = int(low)
    return probe.to(targets.device, targets.dtype)


def _scalar(loss_fn, output, targets) -> float | None:
    try:
        with torch.no_grad():
            value = loss_fn(output, targets)
    except Exception:  # noqa: BLE001 - a loss that does not take the probe: nothing to compare
        return None
    value = value[0] if isinstance(value, list | tuple) else value
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    return float(value.detach().float().reshape(()))


def _gap(attend, loss_fn, whole_out, whole_targets, length: int) -> tuple[float, float, float] | None:
    """``(whole, parts' mean, largest relative gap over the group)`` of ``loss_fn`` on the probe, or None
    where it does not give a finite scalar on every rank (every rank agrees)."""
    index = chunk_positions(attend.rank, attend.n, length // attend.n, attend.balanced)
    device = whole_targets.device

    def part(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(1, index.to(t.device)) if t.dim() >= 2 and t.size(1) == length else t

    with probing():
        whole = _scalar(loss_fn, whole_out, whole_targets)
    mine = _scalar(loss_fn, _map(whole_out, part), part(whole_targets))
    bad = whole is None or mine is None or not (math.isfinite(whole) and math.isfinite(mine))
    stats = torch.tensor([float(bad), 0.0 if bad else mine], dtype=torch.float64, device=device)
    dist.all_reduce(stats, group=attend.group)
    if stats[0] > 0:
        return None
    mean = float(stats[1]) / attend.n
    gap = torch.tensor(abs(mean - whole) / max(abs(whole), 1.0), dtype=torch.float64, device=device)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=attend.group)
    return whole, mean, float(gap)


def check_loss(attend, loss_fn, output, inputs, targets) -> None:
    """Before the first step with ``loss_fn``: its value on a whole probe sequence must equal the mean of
    its values on the ranks' parts (as the gradient sync combines them), else SequenceLossError.

    ``output`` is the split model's output on this rank's ``inputs``; the probe keeps its layout (a
    transformers output, a tensor) at batch 1 and 4 tokens per chunk, with random values (the real
    ones where random ones give no finite loss). Checked once per loss function (its code object): the
    verdict is kept on the split's :class:`~.attention.Attend`. Skipped, every rank alike, where the
    inputs or targets are not tensors, the loss does not run on the probe, or gives no finite scalar."""
    from torch._subclasses.fake_tensor import is_fake

    key = getattr(loss_fn, "__code__", loss_fn)
    if attend.loss_checked is key or attend.n == 1 or is_probing():
        return
    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor) and inputs.dim() >= 2):
        return
    if is_fake(inputs) or inputs.is_meta:
        return
    shape = tuple(inputs.shape[:2])
    length = min(PROBE_TOKENS * 2 * attend.n, shape[1] * attend.n)
    length -= length % (2 * attend.n)
    logits = next((t for t in _tensors(output) if t.is_floating_point() and _per_token(t, shape)), None)
    if logits is None or length == 0:
        return
    probe_targets = _probe_targets(targets, shape, length, logits.size(-1), attend.group)
    results = [
        _gap(attend, loss_fn, _probe_output(output, shape, length, attend.group, v), probe_targets, length)
        for v in VARIANTS
    ]
    results = [r for r in results if r is not None]
    if not results:  # the loss takes no random output (a log of probabilities): the real values
        real = _gap(attend, loss_fn, _probe_output(output, shape, length, attend.group, None), probe_targets, length)
        results = [real] if real is not None else []
    worst = max(results, key=lambda r: r[2], default=None)
    if worst is not None and not worst[2] <= RTOL:
        whole, mean, _ = worst
        raise SequenceLossError(
            attend.who,
            f"loss_fn on a whole probe sequence ({whole:.6g}) differs from the mean of its values on the ranks' parts "
            f"({mean:.6g}), which is what training with each rank holding 1/{attend.n} of every sequence averages: the "
            "loss shifts the targets inside itself (out[:, :-1] against targets[:, 1:]), slices the output along the "
            "sequence, sums instead of averaging, averages over its part's own count of targets padded with "
            "ignore_index, or is not a mean of per-token terms (a per-sequence maximum, a weight of the sequence "
            "length)",
            SHIFT_IN_DATA,
        )
    attend.loss_checked = key


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(obj, lambda t: found.append(t) or t)
    return found


# -- the plan optimizer's guard ---------------------------------------------------------------------


def _signed(value: int) -> int:
    """A saved int64 read back as unsigned (``-1`` as ``2**64 - 1``)."""
    return value - 2**64 if value >= 2**63 else value


def _cut(node, shape: tuple) -> str | None:
    """How ``node`` cuts a tensor of the output's ``(batch, sequence)`` layout along the sequence, or None."""
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if sizes is None or len(sizes) < 2 or (int(sizes[0]), int(sizes[1])) != tuple(shape[:2]):
        return None
    name, length = type(node).__name__, shape[1]
    if name == "RollBackward0":
        return "roll over the sequence" if 1 in [d % len(sizes) for d in node._saved_dims] else None
    dim = getattr(node, "_saved_dim", None)
    if dim is None or _signed(int(dim)) % len(sizes) != 1:
        return None
    if name == "SelectBackward0":
        return f"[:, {_signed(int(node._saved_index))}] (one position)"
    if name == "IndexSelectBackward0":
        return None if node._saved_index.numel() == length else "index_select over the sequence"
    if name == "SliceBackward0":
        start, end, step = (_signed(int(v)) for v in (node._saved_start, node._saved_end, node._saved_step))
        start, end = (v + length if v < 0 else v for v in (start, end))
        if start <= 0 and end >= length and step == 1:
            return None
        return f"[:, {start}:{min(end, length)}{'' if step == 1 else f':{step}'}] (a slice of the sequence)"
    return None


def graph_cuts(loss: torch.Tensor, output_node, shape: tuple, limit: int = 50_000) -> tuple[bool, list[str]]:
    """``(reached, cuts)``: whether ``loss``'s autograd graph reaches the model's ``output_node``, and the
    cuts along the sequence (:func:`_cut`) on the paths between them (not inside the model)."""
    root = loss.grad_fn
    reaches: dict[Any, bool] = {}
    cuts: list[str] = []
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node is output_node:
            reaches[node] = True
            continue
        if not expanded:
            if node in reaches:
                continue
            if len(reaches) > limit:
                return False, []
            reaches[node] = False
            stack.append((node, True))
            stack.extend((child, False) for child, _ in node.next_functions if child is not None)
            continue
        reaches[node] = any(reaches.get(child, False) for child, _ in node.next_functions if child is not None)
        cut = _cut(node, shape) if reaches[node] else None
        if cut:
            cuts.append(cut)
    return root is not None and reaches.get(root, False), cuts


class SequenceLossGuard(OptimizerHook):
    """The plan optimizer's check of the first loss of a split model (see the module docstring): its
    graph when it goes through the optimizer, else the batches' targets against their inputs, before
    the first optimizer step. Decides once, then stays out of the way."""

    def __init__(self, attend, signals: DataSignals):
        self.attend, self.signals, self.decided = attend, signals, False

    def _decide(self) -> None:
        self.decided, self.signals.checking = True, False
        self.attend.output, self.attend.watch_output = None, False  # the graph is not held any longer

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        from torch._guards import detect_fake_mode

        watched = self.attend.output
        if self.decided or watched is None or loss.grad_fn is None or detect_fake_mode() is not None:
            return loss
        reached, cuts = graph_cuts(loss, *watched)
        if not reached:
            return loss  # a loss of something else: the next one is looked at
        if cuts:
            raise SequenceLossError(
                self.attend.who,
                f"the loss cuts the model's output along the sequence ({', '.join(dict.fromkeys(cuts))}): each rank's "
                "output holds chunks of every sequence, so a shift inside the loss (out[:, :-1] against "
                "targets[:, 1:]) pairs the last token of one chunk with the first of another and drops a real "
                "target, and a position picked inside the part is not the sequence's",
                SHIFT_IN_DATA + " (leave tokens out with ignore_index in the targets instead of slicing)",
            )
        self._decide()
        return loss

    def before_step(self, optimizer) -> None:
        from torch._guards import detect_fake_mode

        if self.decided or detect_fake_mode() is not None:  # an estimate runs fake steps: nothing to refuse
            return
        device = next((g.device for g in (optimizer.param_groups[0]["params"] if optimizer.param_groups else ())), None)
        flag = torch.tensor([float(self.signals.targets_equal_inputs)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank decides alike
        self._decide()
        if flag.item() > 0:
            raise SequenceLossError(
                self.attend.who,
                "the batches' targets equal their inputs token for token (transformers' labels=input_ids habit) and "
                "the loss did not go through the plan's optimizer, so it could not be checked: a next-token loss on "
                "such targets shifts them inside itself, which on each rank's chunks of the sequence pairs the last "
                "token of one chunk with the first of another (the step was not taken)",
                SHIFT_IN_DATA + "; or call optim.backward(loss) so the plan checks the loss itself",
            )

"""The numerical check: does the sharded model compute what the whole model computes?

The planner verifies a plan at one rank's *shapes* before any weight moves, but shapes can fit
while the numbers are wrong: a fused ``qkv`` projection split with a head count fixed in the
user's ``__init__`` (``.view(b, t, 3, self.heads, -1)``) reads a rank's half of the width as all
the heads at half the head size, and trains a different model with no error. So before any
training step, one tiny probe forward (the guessed example input, eval mode, the RNG untouched)
runs through the whole model before sharding and through the sharded model after; outputs that
differ beyond floating-point tolerance are refused with :class:`TensorPlanMismatchError`, naming
the fused / reshaped projections and the fix.
"""

from __future__ import annotations

import torch
from torch import nn

from composable_atorch.errors import CompositionError, TensorPlanMismatchError
from composable_atorch.transforms.numerics import evaluating, output_tensor, tolerance
from composable_atorch.transforms.parallel.tensor.graph import example_input


def _moved(x, like: torch.Tensor):
    """The guessed input on the weights' device; an image in their (half) dtype."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.to(like.device, like.dtype) if x.is_floating_point() and like.is_floating_point() else x.to(like.device)


def without_values(model: nn.Module) -> str:
    """Why ``model``'s weights hold no values to compare or broadcast (meta, fake, already distributed), or ""."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    params = list(model.parameters())
    if not params or any(p.is_meta or hasattr(p, "to_local") for p in params):
        return "weights not materialized or already distributed"
    # ``estimate`` applies the plan on fake tensors: there are no values
    if detect_fake_mode() is not None or any(isinstance(p, FakeTensor) for p in params):
        return "fake tensors: the plan is being estimated, not run"
    return ""


def probe(model: nn.Module):
    """``(example, output)`` of the whole model before sharding, or ``(None, why not)``."""
    why = without_values(model)
    if why:
        return None, f"numerical check skipped ({why})"
    params = list(model.parameters())
    example = example_input(model)
    if example is None:
        return None, "numerical check skipped (no example input could be guessed for this model)"
    args, kwargs = example
    args = tuple(_moved(a, params[0]) for a in args)
    kwargs = {k: _moved(v, params[0]) for k, v in kwargs.items()}
    try:
        with evaluating(model):
            out = output_tensor(model(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the model does not take the guessed input: nothing to compare
        return None, f"numerical check skipped (the model does not run on a guessed example input: {type(e).__name__})"
    if out is None:
        return None, "numerical check skipped (the forward returns no floating tensor)"
    return ((args, kwargs), out), ""


def compare(model: nn.Module, reference, group, degree: int, suspects: list[str]) -> str:
    """Run the sharded ``model`` on the probe and compare with ``reference`` (from :func:`probe`);
    every tensor rank agrees on the verdict (the largest difference is all-reduced over ``group``)."""
    import torch.distributed as dist

    (args, kwargs), want = reference
    try:
        with evaluating(model):
            got = output_tensor(model(*args, **kwargs))
    except CompositionError as e:  # the probe itself does not fit (its 8 tokens under sequence parallelism)
        return f"numerical check skipped (the probe input does not fit the sharded model: {e})"
    if got is None or got.shape != want.shape:
        diff = torch.tensor(float("inf"), device=want.device)
    else:
        diff = (got - want).abs().max()
    scale = max(float(want.abs().max()), 1.0)
    if group is not None:
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    tol = tolerance(model) * scale
    rel = float(diff) / scale
    if not float(diff) <= tol:
        shown = ", ".join(suspects[:6]) + (" ..." if len(suspects) > 6 else "")
        raise TensorPlanMismatchError(
            f"at tensor degree {degree} the sharded model's output on a probe input differs from the whole "
            f"model's on the same input and weights (largest difference {rel:.3g} of the output's scale, "
            f"tolerance {tol / scale:.1g}): the shapes fit but the numbers do not, so training would "
            f"silently train another model. Likely: a fused or reshaped projection read with a head count "
            f"fixed at init (.view(..., heads, -1) of a rank's shard gives smaller heads, not fewer) "
            f"among {shown}",
            "keep that layer whole with a manual plan (tensor_parallel({'blocks.*.fc1': 'colwise', "
            "'blocks.*.fc2': 'rowwise'}) or TPInfo().shard_col(...).shard_row(...) naming only the layers "
            "that split right), or read the head count from the width in the forward "
            "(.view(b, t, 3, -1, head_dim)), or name the attention's head-count attribute num_heads so it "
            "is divided",
        )
    return f"sharded output checked against the whole model's on a probe input (difference {rel:.1g} of its scale)"

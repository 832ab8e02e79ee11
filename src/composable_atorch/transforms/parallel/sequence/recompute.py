"""A plain user model's checkpointed blocks keep their attention split when backward recomputes them.

The model's ``scaled_dot_product_attention`` calls are intercepted by a ``TorchFunctionMode``
entered for the root's forward (:class:`.attention.SequenceHooks`). ``checkpoint`` recomputes a
block's forward during backward, after that mode was left: the recomputed attention would attend
to the rank's own part of the sequence only and give other activations (and gradients) than the
forward did. So each block that ``checkpoint`` will wrap gets its forward run under the same mode
when no such mode is active: in backward's recompute, through torch's non-reentrant checkpoint
(which calls the block) and through the reentrant one (whose inner function is this forward).

The forward is bound to the block as a method (not a closure), so a ``copy.deepcopy`` of the model
(a probe replica) runs the copy's own weights with the copy's local :class:`.attention.Attend`.
"""

from __future__ import annotations

import types

from torch import nn
from torch.overrides import _get_current_function_mode_stack

from composable_atorch.runtime.sequence import is_probing
from composable_atorch.transforms._util import outermost_matches
from composable_atorch.transforms.parallel.sequence.attention import Attend, _SDPAMode

#: the block's own forward, kept on it
_INNER = "_composable_sequence_inner_forward"
#: the split's :class:`Attend`, kept on the block for its forward
_ATTEND = "_composable_sequence_block_attend"


def _mode_active() -> bool:
    return any(isinstance(mode, _SDPAMode) for mode in _get_current_function_mode_stack())


def _split_forward(self, *args, **kwargs):
    """The block's forward, under the split's SDPA mode unless one is already active (the root's)."""
    inner = getattr(self, _INNER)
    if is_probing() or _mode_active():
        return inner(*args, **kwargs)
    with _SDPAMode(getattr(self, _ATTEND)):
        return inner(*args, **kwargs)


def intercept_checkpointed(model: nn.Module, attend: Attend, targets: tuple) -> list[str]:
    """Run every block matching ``checkpoint``'s ``targets`` under the SDPA mode (before checkpoint
    wraps them); returns their qualified names. A block matched twice is wrapped once."""
    names = []
    for name, block in outermost_matches(model, targets):
        setattr(block, _ATTEND, attend)
        if getattr(block.forward, "__func__", None) is not _split_forward:
            setattr(block, _INNER, block.forward)
            block.forward = types.MethodType(_split_forward, block)
        names.append(name or "<root>")
    return names

"""What :func:`~composable_atorch.state.load.load_state` returns, and what it says about the load.

``step, extra = load_state(...)`` keeps working (a two-field tuple); the result also says which
checkpoint was read and whether the data position carried over. A checkpoint opened elsewhere
(one process, no plan, another sampler: to evaluate, export or fine-tune) loads its weights,
optimizer and scheduler, but a loader reading another sample order cannot continue the saved
position: that loader is left as given, and ``result.data_position`` / ``result.explain()`` /
``repr(result)`` say so rather than the load failing. ``exact_resume=True`` makes it an error.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class _StepExtra(NamedTuple):
    step: int
    extra: dict[str, Any]


class Resumed(_StepExtra):
    """``(step, extra)`` with the load's account: ``checkpoint``, ``data_position_carried``,
    ``data_position`` (a sentence), ``rng_restored``."""

    checkpoint: str = ""
    data_position_carried: bool = False
    data_position: str = "no loader given"
    rng_restored: bool = False

    @classmethod
    def of(cls, step: int, extra: dict[str, Any], **account: Any) -> Resumed:
        out = cls(step, extra)
        for key, value in account.items():
            if not hasattr(cls, key):
                raise AttributeError(key)
            setattr(out, key, value)
        return out

    def explain(self) -> str:
        lines = [f"loaded {self.checkpoint or 'the checkpoint'} at step {self.step}"]
        carried = "carried over" if self.data_position_carried else "NOT carried over"
        lines.append(f"data position: {carried}: {self.data_position}")
        lines.append(
            "RNG states: restored (same world size)"
            if self.rng_restored
            else "RNG states: left as this process seeded them (another world size, or the loader not resumed)"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        carried = "carried over" if self.data_position_carried else "not carried over"
        return f"Resumed(step={self.step}, extra={self.extra!r}; data position {carried}: {self.data_position})"

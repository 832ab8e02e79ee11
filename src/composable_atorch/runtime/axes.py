"""The parallel axes, declared once: every named dimension of the device mesh ``parallel_mode`` lays out.

An :class:`Axis` says what the core needs to know about a dimension: whether the ranks along it read
different samples (``batch``: the loader splits the global batch over it and gradients are averaged
over it), whether they hold different tokens of the same samples (``split``: a sequence split), the
world size a transform owning it needs, and what its owner does along it (for the messages compose()
writes). ``runtime.layout``'s dimension names, batch dimensions and split dimensions come from here;
a transform's contract names the axis it owns (``Contract(..., axis=TENSOR)``) and compose() derives
the rules every owner shares (:mod:`composable_atorch.core.contract`'s axis rules).

Adding an axis is one line here (and its transform's package): see CONTRIBUTING.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    """One named dimension of the device mesh."""

    name: str
    #: ranks along it read different samples (the batch is split over it; gradients averaged over it)
    batch: bool = False
    #: ranks along it hold different tokens of the same samples (a sequence split)
    split: bool = False
    #: the world size a transform owning it needs (below it, the step is skipped with the reason)
    min_degree: int = 2
    #: what its owner does along it, completing "parallel_mode has no '<name>' dimension to ..."
    verb: str = "shard over"


#: plain data parallelism: different samples per rank, the model replicated
DATA = Axis("data", batch=True, verb="split the batch over")
#: ZeRO / hybrid sharding subgroups inside data parallelism (shard inside, replicate across)
ZERO = Axis("zero", batch=True, verb="shard inside")
#: tensor parallelism: Linear weights sharded, every rank of a group reads the same samples
TENSOR = Axis("tensor", verb="shard over")
#: pipeline stages, one (or a few) per rank
PIPELINE = Axis("pipeline", verb="cut stages over")
#: context parallelism: each rank holds 1/n of every sequence (keys/values gathered for attention)
CONTEXT = Axis("context", split=True, verb="split sequences over")
#: ATorch's sequence parallelism (DeepSpeed-Ulysses): 1/n of every sequence, all-to-all around attention
SEQUENCE = Axis("sequence", split=True, verb="split sequences over")
#: MoE experts split; a batch dimension for everything else (its ranks read different samples)
EXPERT = Axis("expert", batch=True, verb="split the experts over")

#: every axis, in ATorch's naming order
AXES: tuple[Axis, ...] = (DATA, ZERO, TENSOR, PIPELINE, CONTEXT, SEQUENCE, EXPERT)
BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}


def axis(name: str) -> Axis:
    """The declared axis of a dimension name (KeyError for a name that is not one)."""
    return BY_NAME[name]

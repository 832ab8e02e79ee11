"""The walk through the space on paper: from a reference plan, one axis at a time, keep each move that
fits the device and is predicted faster; the rules below say which points need no estimate.

The reference is seed 002's plan: fsdp over the blocks, bf16, every block checkpointed, compiled where
compile is offered. A pass then moves along each axis in :data:`~.axes.AXES` order, from the best plan
so far:

* ``checkpoint`` x ``micro_batches`` together (the memory axis): for each checkpoint level from the
  least recomputation, the fewest micro-batches that fit. Two rules spare estimates there. *Over by
  rule*: a plan is over the device when a plan of the same layout with at least as much checkpointing
  and at least as many micro-batches (less activation memory) is over. *Slower by rule*: a plan is not
  priced when one of the same layout with no more checkpointing and no more micro-batches fits (it
  recomputes and splits no less, and is predicted slower).
  *Over by the line*: with two plans of the same layout and checkpointing priced at different
  micro-batch sizes, a third whose peak on the line through them (activation memory grows with the
  micro-batch's samples) is over the device by more than :data:`LINE_SLACK` is not priced.
* an axis of degrees (tensor, context, ulysses, expert, pipeline): degrees in increasing order until
  one that fits is slower than the best lower degree (the rest are *past the peak*), or the estimate
  fails (the rest of that axis are not priced). A pipeline degree's variants (schedule, micro-batches,
  tensor degree) are priced for the chosen degree, one field away from its first.
* any other axis: every option.

A move over the device at the current memory setting is tried again with lighter ones (more
micro-batches first, then more checkpointing), skipping those a rule or the line says are over, up to
:data:`LIGHTER_TRIES` estimates. A move
that compose() refuses beside the current engine, micro-batches or compile is tried with those left
to compose() (a pipeline syncs its own gradients and runs its own micro-batches). Passes repeat until
one changes nothing, or the time budget is spent. Every point considered is counted by what became of
it; the rest of the space is counted as not on the walk's path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

from composable_atorch.auto.onpaper.axes import Space
from composable_atorch.auto.onpaper.price import FAILED, FITS, OVER, Priced, Pricer
from composable_atorch.auto.space import plan_key

INVALID = "invalid: compose() or a planning rule refused it"
DUPLICATE = "the same plan as another point"
OVER_RULE = "over memory by rule: a plan of the same layout with less activation memory is over"
OVER_LINE = "over memory by the line through two micro-batch sizes of the same plan priced"
SLOWER_RULE = "slower by rule: a plan of the same layout with less recomputation and fewer micro-batches fits"
PAST_PEAK = "past the peak: a lower degree of its axis fitted and was faster"
FAILED_AXIS = "not priced: the estimate failed for a lower degree of its axis"
TIME = "not priced: the time budget was spent"
#: axes walked together as the memory axis, or only in the last step (compile: the eager twin of the pick)
MEMORY, LAST = ("checkpoint", "micro_batches"), ("compile",)
#: the axes a refused move is retried without, in this order
COMPANIONS = ("engine", "micro_batches", "compile")
MAX_PASSES = 3
#: lighter memory settings tried for a move that is over the device
LIGHTER_TRIES = 3
#: how far over the device a peak on the line must be for its plan to be dropped unpriced
LINE_SLACK = 0.1


class Walk:
    """One walk over ``space`` with ``pricer``; :meth:`run` returns the priced plans."""

    def __init__(self, space: Space, pricer: Pricer, max_priced: int | None = None, progress=None):
        self.space, self.pricer, self.max_priced, self.progress = space, pricer, max_priced, progress
        self.dropped: Counter[str] = Counter()
        self.seen: dict[frozenset, Priced | None] = {}  # considered assignment -> its price (None: none)
        self.priced: dict[str, Priced] = {}
        self.failures: dict[str, str] = {}  # a reason the estimate gave, per axis move

    # -- one point ---------------------------------------------------------------------------
    def consider(self, assignment: dict[str, str]) -> Priced | None:
        frozen = frozenset(assignment.items())
        if frozen in self.seen:
            return self.seen[frozen]
        self.seen[frozen] = None
        plan, used = self._compose(assignment)
        if plan is None:
            self.dropped[INVALID] += 1
            return None
        key = plan_key(plan)
        if key in self.priced:
            self.dropped[DUPLICATE] += 1
            self.seen[frozen] = self.priced[key]
            return self.priced[key]
        if self.max_priced is not None and len(self.priced) >= self.max_priced:
            self.dropped[TIME] += 1
            return None
        priced = self.pricer(plan, used)
        if priced is None:
            self.dropped[TIME] += 1
            return None
        if self.progress is not None:
            self.progress(priced)
        self.priced[priced.key] = priced
        self.seen[frozen] = priced
        return priced

    def _compose(self, assignment: dict[str, str]):
        plan, _ = self.space.point(assignment)
        if plan is not None:
            return plan, assignment
        retry = dict(assignment)
        for name in COMPANIONS:
            axis = self.space.axes.get(name)
            if axis is None:
                continue
            for label in axis.fallbacks(retry.get(name)):
                plan, _ = self.space.point({**retry, name: label})
                if plan is not None:
                    return plan, {**retry, name: label}
            retry[name] = axis.implied or retry[name]
        return None, assignment

    def skip(self, assignment: dict[str, str], reason: str) -> None:
        frozen = frozenset(assignment.items())
        if frozen not in self.seen:
            self.seen[frozen] = None
            self.dropped[reason] += 1

    @property
    def spent(self) -> bool:
        left = self.pricer.left()
        return (left is not None and left <= 0) or (
            self.max_priced is not None and len(self.priced) >= self.max_priced
        )

    # -- the walk ------------------------------------------------------------------------------
    def run(self, reference: dict[str, str]) -> Priced | None:
        best = self.fitting(reference)
        current = best.assignment if best is not None else reference
        for _ in range(MAX_PASSES):
            before = dict(current)
            current = self.memory_step(current)
            for name in self.space.axes:
                if name in MEMORY or name in LAST or self.spent:
                    continue
                current = self.axis_step(name, current)
            if current == before or self.spent:
                break
        self.last_step(current)
        return self.best()

    def best(self) -> Priced | None:
        fits = [p for p in self.priced.values() if p.fits]
        return max(fits, key=lambda p: p.speed, default=None)

    def fitting(self, assignment: dict[str, str]) -> Priced | None:
        """``assignment`` priced; while over, the next lighter memory setting (:meth:`lighter`), up to
        :data:`LIGHTER_TRIES` of them; the one that fits, or None."""
        priced = self.consider(assignment)
        for _ in range(LIGHTER_TRIES):
            if priced is None or priced.status != OVER:
                break
            nxt = self.lighter(priced.assignment)
            if nxt is None:
                break
            priced = self.consider(nxt)
        return priced if priced is not None and priced.fits else None

    def lighter(self, assignment: dict[str, str]) -> dict[str, str] | None:
        """The next memory setting to try after ``assignment`` was over: lighter in one memory axis and no
        heavier in the other, not known over by a rule or the line; the least recomputation first, then
        the fewest micro-batches (each micro-batch more is an estimate's simulation more)."""
        axes = [a for a in MEMORY if a in self.space.axes]
        here = {a: self._weight(a, assignment[a]) for a in axes}
        points = [dict(assignment)]
        for a in axes:
            points = [{**p, a: label} for p in points for label in self.space.axes[a].options
                      if self._weight(a, label) <= here[a]]
        order = sorted(points, key=lambda p: tuple(-self._weight(a, p[a]) for a in axes))
        for point in order:
            if point == assignment or frozenset(point.items()) in self.seen:
                continue
            if self._relation(point, OVER, lighter=True) or self._over_line(point):
                continue
            return point
        return None

    # -- the memory axis ----------------------------------------------------------------------
    def _weight(self, axis: str, label: str) -> int:
        """Activation memory order of a memory axis option, larger is heavier: no checkpointing over
        selective over full; one micro-batch over more."""
        option = self.space.axes[axis].options[label]
        if axis == "checkpoint":
            return 2 if option.absent else {"selective": 1}.get(option.transforms[0].policy, 0)
        return -(1 if option.absent else option.transforms[-1].steps)

    def _layout(self, assignment: dict[str, str]) -> frozenset:
        return frozenset((k, v) for k, v in assignment.items() if k not in MEMORY)

    def _relation(self, assignment: dict[str, str], status: str, lighter: bool) -> bool:
        """A priced plan of the same layout with ``status``, lighter (or heavier) in every memory axis."""
        layout = self._layout(assignment)
        for (other, priced) in ((dict(f), p) for f, p in self.seen.items() if p is not None):
            if priced.status != status or self._layout(other) != layout or other == assignment:
                continue
            ok = all(
                (self._weight(a, other[a]) <= self._weight(a, assignment[a]))
                if lighter
                else (self._weight(a, other[a]) >= self._weight(a, assignment[a]))
                for a in MEMORY
                if a in assignment
            )
            if ok:
                return True
        return False

    def memory_step(self, current: dict[str, str]) -> dict[str, str]:
        axes = [a for a in MEMORY if a in self.space.axes]
        if not axes:
            return current
        levels = {a: sorted(self.space.axes[a].options, key=lambda lab, a=a: -self._weight(a, lab)) for a in axes}
        checkpoints = levels.get("checkpoint", [current.get("checkpoint")])
        micro = levels.get("micro_batches", [current.get("micro_batches")])
        for ck in checkpoints:
            for mb in micro:
                point = {**current, **({"checkpoint": ck} if ck else {}), **({"micro_batches": mb} if mb else {})}
                if self.spent:
                    return self._best_of(current)
                if self._relation(point, OVER, lighter=True):
                    self.skip(point, OVER_RULE)
                elif self._relation(point, FITS, lighter=False):
                    self.skip(point, SLOWER_RULE)
                elif self._over_line(point):
                    self.skip(point, OVER_LINE)
                else:
                    self.consider(point)
        return self._best_of(current)

    def _over_line(self, assignment: dict[str, str]) -> bool:
        """The peak of ``assignment`` on the line through two priced plans of its layout and checkpointing
        (peak against samples per micro-batch) is over the device by more than LINE_SLACK."""
        key = self._layout(assignment), assignment.get("checkpoint")
        same = [p for f, p in self.seen.items() if p is not None and p.peak_bytes and p.micro_batch
                and p.micro_batches and (self._layout(dict(f)), dict(f).get("checkpoint")) == key]
        points = {p.micro_batch: p.peak_bytes for p in same}
        if len(points) < 2 or "micro_batches" not in assignment:
            return False
        samples = same[0].micro_batch * same[0].micro_batches  # per rank, the same for every point of a layout
        count = -self._weight("micro_batches", assignment["micro_batches"])
        if samples % count:
            return False
        (m1, p1), (m2, p2) = sorted(points.items())[:2]
        slope = (p2 - p1) / (m2 - m1)
        peak = p1 + slope * (samples // count - m1)
        return slope > 0 and peak * (1 + self.pricer.margin) > self.pricer.limit * (1 + LINE_SLACK)

    def _best_of(self, current: dict[str, str]) -> dict[str, str]:
        """The fastest fitting plan priced so far whose layout is ``current``'s, or ``current``."""
        layout = self._layout(current)
        fits = [p for f, p in self.seen.items() if p is not None and p.fits and self._layout(dict(f)) == layout]
        best = max(fits, key=lambda p: p.speed, default=None)
        return dict(best.assignment) if best is not None else current

    # -- the other axes -------------------------------------------------------------------------
    def axis_step(self, name: str, current: dict[str, str]) -> dict[str, str]:
        axis = self.space.axes[name]
        here = self.seen.get(frozenset(current.items()))
        best = here if here is not None and here.fits else None
        if any(o.degree > 1 for o in axis.options.values()):
            found = self._degrees(name, current, best)
        else:
            found = [self.fitting({**current, name: label}) for label in self._nearest(name, current.get(name))]
        for priced in found:
            if priced is not None and (best is None or priced.speed > best.speed):
                best = priced
        return dict(best.assignment) if best is not None else current

    def _nearest(self, name: str, mine: str | None) -> list[str]:
        """The axis's other options, those sharing the most kinds with the current one first (bf16 with fp8
        before fp32 alone), so a budget cut short leaves out the farthest."""
        options = self.space.axes[name].options
        kinds = {t.name for t in options[mine].transforms} if mine in options else set()
        others = [label for label in options if label != mine]
        return sorted(others, key=lambda label: len(kinds ^ {t.name for t in options[label].transforms}))

    def _degrees(self, name: str, current: dict[str, str], best: Priced | None) -> list[Priced | None]:
        options = self.space.axes[name].options
        primaries: dict[int, str] = {}
        for label, option in sorted(options.items(), key=lambda kv: (kv[1].degree, _variant_rank(kv[1]))):
            primaries.setdefault(option.degree, label)
        found, top = [], None
        base = self.fitting({**current, name: primaries[1]}) if 1 in primaries else best
        top = base
        walked = [label for degree, label in sorted(primaries.items()) if degree > 1]
        for i, label in enumerate(walked):
            priced = self.fitting({**current, name: label})
            found.append(priced)
            last = self.seen.get(frozenset({**current, name: label}.items()))
            if last is not None and last.status == FAILED:
                self.failures[name] = last.reason or ""
                for rest in walked[i + 1 :]:
                    self.skip({**current, name: rest}, FAILED_AXIS)
                break
            if priced is None:
                continue
            if top is not None and priced.speed < top.speed:
                for rest in walked[i + 1 :]:
                    self.skip({**current, name: rest}, PAST_PEAK)
                break
            top = priced
        if top is not None and top is not base:
            chosen = top.assignment.get(name)
            found += [self.fitting({**current, name: v}) for v in self._variants(name, chosen)]
        return [base, *found]

    def _variants(self, name: str, chosen: str | None) -> list[str]:
        """The options of the chosen degree one config field away from it (schedule, micro-batches, tensor)."""
        options = self.space.axes[name].options
        if chosen not in options:
            return []
        mine = options[chosen]
        return [
            label
            for label, o in options.items()
            if label != chosen and o.degree == mine.degree and _distance(mine, o) == 1
        ]

    def last_step(self, current: dict[str, str]) -> None:
        """The pick's eager twin, for the table (compile's gain said, not assumed), where time is left."""
        for name in LAST:
            if name in self.space.axes and not self.spent:
                for label in self.space.axes[name].options:
                    if label != current.get(name):
                        self.consider({**current, name: label})

    # -- what became of the space --------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Points by what became of them: priced (fits / over / failed), a rule, or not on the path."""
        out = Counter(self.dropped)
        for priced in self.priced.values():
            out[{FITS: "priced: fits", OVER: f"priced: {OVER}", FAILED: f"priced: {FAILED}"}[priced.status]] += 1
        out["not on the walk's path (one axis moved at a time from the best so far)"] = max(
            0, self.space.size - len(self.seen)
        )
        return dict(out)


def _variant_rank(option) -> tuple:
    """A pipeline option's place among those of its degree: 1F1B, no tensor degree, fewest micro-batches first."""
    t = next((t for t in option.transforms if t.name == "mixed_parallel"), None)
    if t is None:
        return ()
    return (t.schedule != "1F1B", t.tensor or 1, t.microbatches, t.schedule)


def _distance(a, b) -> int:
    """Config fields in which two options' transforms differ (their transforms paired in order)."""
    if len(a.transforms) != len(b.transforms):
        return 99
    n = 0
    for x, y in zip(a.transforms, b.transforms, strict=True):
        if type(x) is not type(y):
            return 99
        n += sum(getattr(x, f.name) != getattr(y, f.name) for f in fields(x))
    return n

"""Plan: ordered steps, each with the reason for its place; data for machines, text for people.

A plan is data: applying it changes nothing in it. ``plan.apply(...)`` returns the
:class:`TrainState` it produced (with the report of what each step did); ``plan(...)`` returns an
:class:`Applied` triple that unpacks as ``model, optim, loader`` and carries that state, so
``plan.explain(applied=result)`` shows what was swapped while ``plan.explain()`` stays the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from composable_atorch.core import codec, passes, untrusted
from composable_atorch.core.context import ApplyContext, TrainState
from composable_atorch.core.registry import build
from composable_atorch.environment import Environment
from composable_atorch.errors import ConfigError, ParameterMappingError, RequirementError
from composable_atorch.runtime.loader import check_dataset_size
from composable_atorch.runtime.optim import PlanOptimizer, named_parameters, parameter_names, rebuild_optimizer
from composable_atorch.runtime.resumable import can_resume, resumable

FORMAT = "composable_atorch.plan"
VERSION = 1


@dataclass(frozen=True)
class Step:
    transform: Any  # a Transform (the base class sits above the plan: it composes with |)
    reasons: tuple[str, ...]
    implied_by: str | None = None


@dataclass(frozen=True, eq=False)
class Plan:
    """The result of compose(). Apply it with ``model, optim, loader = plan(model, optim, loader)``.

    Two plans are equal when they hold the same steps in the same order and the same notes; the
    environment they were checked against is shown by explain() but is not part of equality.
    """

    steps: tuple[Step, ...]
    requested: tuple[Any, ...]  # Transforms, as asked for
    notes: tuple[str, ...] = ()
    env: Environment = field(default_factory=Environment)
    strict: bool = False

    # -- data -------------------------------------------------------------------------------
    @property
    def transforms(self) -> tuple[Any, ...]:
        return tuple(s.transform for s in self.steps)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.transforms)

    def __eq__(self, other):
        if not isinstance(other, Plan):
            return NotImplemented
        return self.steps == other.steps and self.notes == other.notes and self.requested == other.requested

    def __hash__(self):
        return hash((self.steps, self.notes))

    def __len__(self):
        return len(self.steps)

    def __or__(self, other):
        return Plan.composed((self, other), strict=self.strict, env=self.env)

    def __ror__(self, other):
        return Plan.composed((other, self), strict=self.strict, env=self.env)

    @classmethod
    def composed(cls, items, *, strict: bool = False, env: Environment | None = None) -> Plan:
        """What :func:`~composable_atorch.core.compose.compose` returns: ``items`` run through the
        passes (:mod:`.passes`) in ``env`` (detected when None). ``|`` and :meth:`from_dict` call it
        here, so nothing has to find compose() at run time."""
        env = Environment.detect() if env is None else env
        requested, steps, notes = passes.run(items, strict=strict, env=env)
        return cls(steps=tuple(Step(*s) for s in steps), requested=requested, notes=notes, env=env, strict=strict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "strict": self.strict,
            "transforms": [{"name": t.name, "config": codec.encode(t.config())} for t in self.requested],
            # informational: recomputed on load
            "steps": [t.name for t in self.transforms],
            "notes": list(self.notes),
            "environment": self.env.describe(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def named_objects(self) -> tuple[Any, ...]:
        """The classes and functions the requested transforms' configs hold: what this plan's JSON names.

        Pass them as ``allow`` where the library reads back a plan it wrote itself (another rank, a
        trial's processes): the user handed them over in code, so they need not pass the allow-list
        (see :mod:`.codec`)."""
        return codec.named_objects([t.config() for t in self.requested])

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, env: Environment | None = None, strict: bool | None = None, allow=()
    ) -> Plan:
        """The plan ``data`` describes, composed for ``env``. Classes and functions it names resolve
        only against ``allow`` and what this process has imported (see :mod:`.codec`): never imported."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(
                "plan format", data.get("format") if isinstance(data, dict) else type(data).__name__, repr(FORMAT)
            )
        if data.get("version") != VERSION:
            raise ConfigError("plan version", data.get("version"), str(VERSION))
        if not isinstance(data.get("strict", False), bool):
            raise ConfigError("plan strict", data.get("strict"), "true or false")
        untrusted.check_depth(data, "plan")
        entries = data.get("transforms")
        if not isinstance(entries, list):
            raise ConfigError("plan transforms", entries, "a list of {'name': ..., 'config': {...}}")
        transforms = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ConfigError(f"plan transforms[{i}]", entry, "{'name': str, 'config': {...}}")
            config = codec.decode(entry.get("config", {}), allow)
            transforms.append(build(entry["name"], config))
        return Plan.composed(transforms, strict=data.get("strict", False) if strict is None else strict, env=env)

    @classmethod
    def from_json(cls, text: str, *, env: Environment | None = None, strict: bool | None = None, allow=()) -> Plan:
        try:
            data = untrusted.loads(text, "plan JSON")
        except json.JSONDecodeError as exc:
            raise ConfigError(
                "plan JSON", text[:60], f"valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            ) from None
        return cls.from_dict(data, env=env, strict=strict, allow=allow)

    # -- people -----------------------------------------------------------------------------
    def explain(self, applied: Applied | TrainState | None = None) -> str:
        """The plan for people; with ``applied`` (what ``plan(...)`` / ``plan.apply(...)`` returned)
        also what each step did. The plan's own text never changes by applying it."""
        lines = [
            f"Plan with {len(self.steps)} step(s) for {self.env.describe()}" + (" [strict]" if self.strict else "")
        ]
        for i, step in enumerate(self.steps, 1):
            t = step.transform
            implied = f"  (implied by {step.implied_by})" if step.implied_by else ""
            lines.append(f"  {i}. {t.describe()}{implied}")
            lines.extend(f"       - {r}" for r in step.reasons)
            c = t.contract
            active = [r.describe() for r in c.requires if r.unmet(self.env, t) is None and _applies(r, t)]
            if active:
                lines.append(f"       - requires: {'; '.join(active)}")
            if c.reads:
                lines.append(f"       - reads: {', '.join(c.reads)}")
        if not self.steps:
            lines.append("  (no steps: the plan returns the triple unchanged)")
        checked = ", ".join(self.names) or "nothing"
        lines.append(f"Checked: requirements, conflicts and ordering of {checked}.")
        used = passes.axes_note(self.transforms)
        if used:
            lines.append(f"Checked: {used}.")
        if self.notes:
            lines.append("Notes:")
            lines.extend(f"  - {n}" for n in self.notes)
        report = (
            applied.state.report if isinstance(applied, Applied) else (applied.report if applied is not None else {})
        )
        if report:
            lines.append("Applied:")
            for name, entries in report.items():
                lines.append(f"  {name}:")
                lines.extend(f"    - {e}" for e in entries)
        return "\n".join(lines)

    def __str__(self):
        return self.explain()

    # -- application ------------------------------------------------------------------------
    def check_runtime(self, runtime: Environment | None = None) -> None:
        """Refuse to apply a plan checked for another world size or device kind."""
        runtime = Environment.detect() if runtime is None else runtime
        if runtime.world_size != self.env.world_size:
            raise RequirementError(
                "plan",
                f"a world size of {self.env.world_size}, as it was composed for (this run has {runtime.world_size})",
                f"compose the plan again here (Plan.from_json(text) re-checks it), or launch {self.env.world_size} "
                "processes",
            )
        if runtime.device != self.env.device:
            raise RequirementError(
                "plan", f"a {self.env.device} device (this run is on {runtime.device})", "compose it again here"
            )

    def apply(self, model, optim=None, loader=None, *, runtime: Environment | None = None) -> TrainState:
        """Apply every step in order and return the full :class:`TrainState`."""
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
        if optim is not None and not isinstance(optim, torch.optim.Optimizer):
            raise ConfigError("optim", type(optim).__name__, "a torch.optim.Optimizer, or None")
        if isinstance(optim, PlanOptimizer):
            raise ConfigError(
                "optim", "a PlanOptimizer", "the user's own optimizer (a plan is applied once, to the original triple)"
            )
        self.check_runtime(runtime)
        # an empty or too-small dataset would train 0 steps or one padded batch, silently
        check_dataset_size(loader)
        state = TrainState(model=model, optim=optim, loader=loader, param_names=parameter_names(model, optim))
        ctx = ApplyContext(plan=self, env=self.env, strict=self.strict)
        names = sorted(named_parameters(model))
        for step in self.steps:
            state = step.transform.apply(state, ctx.for_step(step.transform))
            if not step.transform.contract.renames:
                names = check_names_kept(step.transform.name, names, state.model)
            else:  # later steps are checked against the names this step left (a pipeline stage keeps a subset)
                names = sorted(named_parameters(state.model))
            if state.optim is not None and isinstance(state.optim, torch.optim.Optimizer):
                state.optim = rebuild_optimizer(state.optim, state.param_names, state.model)
        return state

    def __call__(self, model, optim=None, loader=None) -> Applied:
        """Apply, and return ``(model, optim, loader)`` to train (an :class:`Applied`, which also holds the state)."""
        state = self.apply(model, optim, loader)
        wrapped = (
            None
            if state.optim is None
            else PlanOptimizer(state.optim, state.hooks, parallel=state.parallel, runner=state.runner)
        )
        # the returned loader tracks its data position, so save_state/load_state can resume it
        loader = resumable(state.loader) if can_resume(state.loader) else state.loader
        return Applied(state.model, wrapped, loader, state=state)


class Applied(tuple):
    """What ``plan(model, optim, loader)`` returns: unpacks as the triple; ``.state`` (and ``.report``)
    say what each step did (pass it to ``plan.explain(applied=...)``)."""

    state: TrainState

    def __new__(cls, model, optim, loader, *, state: TrainState):
        self = super().__new__(cls, (model, optim, loader))
        self.state = state
        return self

    @property
    def report(self) -> dict[str, list[str]]:
        return self.state.report


def _applies(req, transform) -> bool:
    """False for a When(...) requirement whose condition does not hold for this config."""
    predicate = getattr(req, "predicate", None)
    return predicate is None or bool(predicate(transform))


def check_names_kept(step: str, before: list[str], model) -> list[str]:
    """torch's @contract habit: a step keeps every parameter name unless its contract says ``renames=True``."""
    after = sorted(named_parameters(model))
    if after != before:
        lost, new = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        what = f"lose or rename parameters at step {step!r}, whose contract does not declare renames=True"
        raise ParameterMappingError(what, [f"-{n}" for n in lost] + [f"+{n}" for n in new])
    return after

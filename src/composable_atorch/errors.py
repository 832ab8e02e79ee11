"""Typed errors, all raised before any work is done, each naming the fix.

Every error a user can cause derives from :class:`CompositionError`, so
``except CompositionError`` catches exactly "you asked for something that cannot be done",
never a bug inside a transform.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class CompositionError(Exception):
    """Base class of every user-facing error in composable_atorch."""


class UnknownTransformError(CompositionError, KeyError):
    """A transform (or ATorch strategy) name that the registry does not know."""

    def __init__(self, name: str, valid: Iterable[str], *, note: str | None = None):
        self.name = name
        self.valid = sorted(valid)
        self.suggestion = next(iter(difflib.get_close_matches(name, self.valid, n=1)), None)
        msg = f"unknown transform {name!r}"
        if note:
            msg += f": {note}."
        if self.suggestion:
            msg += f"; did you mean {self.suggestion!r}?"
        msg += f" Valid names: {', '.join(self.valid)}."
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class AlreadyAppliedError(CompositionError):
    """A second application of one kind to the same module (torch's composable ``contract`` refuses it too)."""

    def __init__(self, kind: str, module: object):
        self.kind = kind
        super().__init__(
            f"{kind} was already applied to this {type(module).__name__}; applying it twice would wrap or split it "
            f"twice. Fix: apply each plan to a fresh model (a plan holds one {kind} step)"
        )


class ConflictError(CompositionError):
    """Two transforms that cannot be combined (or orderings that contradict each other)."""

    def __init__(self, first: str, second: str, reason: str, fix: str):
        self.first, self.second, self.reason, self.fix = first, second, reason, fix
        super().__init__(f"{first!r} conflicts with {second!r}: {reason}. Fix: {fix}.")


class RequirementError(CompositionError):
    """A transform needs something the environment lacks (world size, device, package...)."""

    def __init__(self, transform: str, missing: str, fix: str):
        self.transform, self.missing, self.fix = transform, missing, fix
        super().__init__(f"{transform!r} needs {missing}. Fix: {fix}.")


class ConfigError(CompositionError, ValueError):
    """A bad configuration value: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"bad value for {field}: {value!r}; allowed: {allowed}.")


class ParameterMappingError(CompositionError):
    """Rebuilding the optimizer by parameter name would lose or duplicate a parameter."""

    def __init__(self, problem: str, names: Iterable[str]):
        self.problem, self.names = problem, sorted(names)
        shown = ", ".join(self.names[:8]) + (" ..." if len(self.names) > 8 else "")
        super().__init__(
            f"rebuilding the optimizer by parameter name would {problem}: {shown}. "
            "Fix: build the optimizer over model.parameters() (or named groups of them) of the model you pass "
            "to the plan, and apply the plan before the first optimizer step."
        )


class WorkloadError(CompositionError):
    """The user's model, optimizer, data or loss fails on its own, before any plan is applied: no plan
    can fix it, so the search stops at once. Names the part that failed, the error and the fix."""

    def __init__(self, part: str, error: BaseException | str, hint: str):
        self.part, self.hint = part, hint
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"{part} fails with no plan applied ({self.error}); no plan can fix that. Fix: {hint}.")


class UntrustedInputError(ConfigError):
    """A plan, checkpoint or data file asks for something that is never done on a file's say-so:
    importing a module, naming a class or function outside the allow-list, reading a non-regular
    or oversized file, nesting deeper than the bound. Names the field and the fix."""


class CheckpointError(ConfigError):
    """A checkpoint directory that is damaged, incomplete or not what ``save_state`` wrote (a
    checksum that differs, a truncated shard, a malformed ``checkpoint.json``, DCP failing to read
    it). Names the file; the live model and optimizer are left as they were."""

    def __init__(
        self,
        path: object,
        problem: str,
        fix: str = "load an intact checkpoint (save it again, or pick an older step-* directory)",
    ):
        self.path, self.problem, self.fix = str(path), problem, fix
        CompositionError.__init__(self, f"checkpoint file {self.path}: {problem}. Fix: {fix}.")
        self.field, self.value, self.allowed = f"checkpoint file {self.path}", problem, fix


class CheckpointWriteError(CheckpointError):
    """A save that could not be written (a full disk, a quota, a directory that is not writable),
    on any rank: every rank raises the same one, naming the directory, the step and the cause.
    Nothing was published: the partial copy is removed, the previous checkpoint is still the one
    ``load_state`` opens, and training can go on and save again once the cause is fixed.
    ``errno`` is the failed write's (``errno.ENOSPC`` for a full disk) or None; ``needed_bytes``
    what the save writes in all, when known; ``latest`` the checkpoint that stays the latest."""

    def __init__(
        self,
        directory: object,
        step: int,
        problem: str,
        fix: str,
        *,
        errno: int | None = None,
        needed_bytes: int | None = None,
        latest: str | None = None,
    ):
        self.path, self.problem, self.fix = str(directory), problem, fix
        self.directory, self.step, self.errno, self.needed_bytes, self.latest = (
            str(directory),
            step,
            errno,
            needed_bytes,
            latest,
        )
        CompositionError.__init__(self, f"saving step {step} into {directory} failed: {problem}. Fix: {fix}.")
        self.field, self.value, self.allowed = f"checkpoint directory {directory}", problem, fix


class NonFiniteError(CompositionError, FloatingPointError):
    """A training step met inf/nan (``amp`` / ``half`` with ``nonfinite="raise"``): raised before the
    weights or the optimizer state change, so the run can stop or go back to a checkpoint."""

    def __init__(self, step: int, where: str):
        self.step, self.where = step, where
        super().__init__(
            f"step {step}: the {where} hold inf/nan; the step was not taken (weights and optimizer state unchanged). "
            "The inf/nan gradients are still in .grad: call optim.zero_grad() before the next backward, which "
            "would add to them. Fix: lower the learning rate, clip gradients (clip_grad), check the data and loss, "
            "or pass nonfinite='skip' to skip such steps."
        )


class DatasetSizeError(CompositionError, ValueError):
    """The dataset holds no sample, or fewer than one global batch: training would run 0 steps
    (``drop_last``) or one short batch of padded repeats, silently. Names the sizes."""

    def __init__(self, samples: int, global_batch: int):
        self.samples, self.global_batch = samples, global_batch
        what = (
            "is empty" if samples == 0 else f"holds {samples} sample(s), fewer than one global batch of {global_batch}"
        )
        super().__init__(
            f"the loader's dataset {what}. Fix: pass a dataset with at least {global_batch} samples, "
            f"or a loader whose batch_size (the global batch) is at most the dataset's size."
        )


class TensorPlanMismatchError(ConfigError):
    """A tensor-parallel plan whose sharded model computes another output than the whole model on the
    same probe input and weights (shapes fit, numbers do not: a silent wrong result). Raised before
    any training step; names the likely layers and the fix."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        CompositionError.__init__(self, f"tensor_parallel: {problem}. Fix: {fix}.")
        self.field, self.value, self.allowed = "tensor_parallel.plan", problem, fix


class SequenceSplitMismatchError(ConfigError):
    """A sequence split (context parallelism, Ulysses) whose model computes another output than the
    whole model on the same probe tokens and weights: a token mixer outside attention (a convolution,
    a state-space or linear-attention layer), an attention bias or feature the split does not carry
    over. Raised before any training step; names the fix."""

    def __init__(self, who: str, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        CompositionError.__init__(self, f"{who}: {problem}. Fix: {fix}.")
        self.field, self.value, self.allowed = f"{who}.model", problem, fix


class SequenceInputError(ConfigError):
    """A batch every rank of a sequence split's group holds alike: each rank of context parallelism or
    Ulysses trains on its own part of every sequence (the loader the plan returns cuts it), so the
    same whole batch on every rank (the user's own loader, not passed to the plan) would train on
    wrong positions and attention, silently. Raised in the forward, before that step's work; names
    the fix."""

    def __init__(self, who: str, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        CompositionError.__init__(self, f"{who}: {problem}. Fix: {fix}.")
        self.field, self.value, self.allowed = f"{who}.inputs", problem, fix


class SequenceLossError(ConfigError):
    """A loss that does not train a sequence split (context parallelism, Ulysses) as one process:
    it shifts the targets inside itself (``out[:, :-1]`` against ``y[:, 1:]``: each rank holds
    chunks of the sequence, so the shift pairs the last token of one chunk with the first of
    another and drops a real target), slices the output along the sequence, or is not a sum of
    per-token terms (a per-sequence maximum, a weight that depends on the sequence length). Raised
    before the optimizer step, the weights unchanged; names the fix."""

    def __init__(self, who: str, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        CompositionError.__init__(self, f"{who}: {problem}. Fix: {fix}.")
        self.field, self.value, self.allowed = f"{who}.loss", problem, fix

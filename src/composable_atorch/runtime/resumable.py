"""The data position and RNG states a checkpoint needs to continue with exactly the next batch.

A resumed run reproduces the uninterrupted one bitwise only if three things come back: the
weights and optimizer (DCP's job, see checkpointing.py), the random number generators, and the
position in the data. A plain ``DataLoader`` does not know how far it has been iterated, so
:func:`resumable` makes it know, in place — the way FSDP2's ``fully_shard`` swaps a module's
class for a subclass — keeping the object, its sampler and every setting:

* each ``iter(loader)`` starts a *pass*; the loader records the pass's epoch (the sampler's
  ``epoch`` when it has one, e.g. ``DistributedSampler``; otherwise the pass index), the RNG
  states at the start of the pass, and how many batches it has handed out;
* after ``loader.resume_at(...)``, the next pass replays the start of the saved pass
  (same RNG states, same sampler epoch, so the same permutation and worker seeds), skips the
  batches already consumed at the index level (no data is loaded for them), and then puts the
  RNG states of the moment of the save back, so training continues bitwise.

At another world size or layout the saved position is read as *global samples* consumed in the
epoch (:func:`resume_batches`): a ``DistributedSampler`` reads the same global order at any replica
count (:func:`order_of`), so each rank skips ``samples / (its batch x the data ranks)`` batches and
the run continues with the very next global batch; per-rank RNG states do not carry over there.
A loader that reads another order, or batches that the consumed samples do not fill, is a
ConfigError rather than a resume that repeats or skips samples.

The loader does not call ``set_epoch`` for you: keep calling it as torch documents. A resumed
pass uses the saved epoch whatever was set before it; ``loader.epoch`` tells a resumed loop
which epoch it is in. Everything here is JSON-able (base64 for RNG bytes): no pickle.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from composable_atorch.errors import ConfigError


# -- RNG states as JSON --------------------------------------------------------------------------
def _bytes_of(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _state_of(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """The process's RNG states (torch CPU and CUDA, Python ``random``, NumPy) as JSON values."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _bytes_of(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_of(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency, but its RNG is only restored when present
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` recorded."""
    torch.set_rng_state(_state_of(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_state_of(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# -- the loader ----------------------------------------------------------------------------------
def _generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """The loader's own torch.Generators (loader, sampler, batch sampler's sampler), by role."""
    found = {"loader": loader.generator, "sampler": getattr(loader.sampler, "generator", None)}
    inner = getattr(loader.batch_sampler, "sampler", None)
    found["batch_sampler"] = getattr(inner, "generator", None)
    return {k: g for k, g in found.items() if isinstance(g, torch.Generator)}


def _epoch_sampler(loader: DataLoader):
    """The sampler that takes ``set_epoch`` (a DistributedSampler, possibly inside the batch sampler)."""
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None), loader.batch_sampler):
        if callable(getattr(candidate, "set_epoch", None)):
            return candidate
    return None


@dataclass
class DataPosition:
    """Where a resumable loader is: the current pass's epoch and the batches it handed out."""

    epoch: int = 0
    batches: int = 0
    passes: int = 0
    #: RNG states (global and the loader's generators) at the start of the current pass
    pass_rng: dict[str, Any] | None = None
    #: set by resume_at(): what the next pass replays
    pending: dict[str, Any] | None = None

    #: global samples per batch this loader hands out (its batch x the data ranks); None: unknown
    per_batch: int | None = None
    #: the global sample order the loader reads (see :func:`order_of`)
    order: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"epoch": self.epoch, "batches": self.batches, "passes": self.passes, "pass_rng": self.pass_rng}
        if self.per_batch is not None:
            out.update(samples=self.batches * self.per_batch, per_batch=self.per_batch, order=self.order)
        return out


# -- the position as global samples --------------------------------------------------------------
def order_of(loader: DataLoader) -> tuple[dict[str, Any] | None, int | None]:
    """``(order, global samples per batch)`` of a loader, or ``(None, None)`` for a custom sampler.

    A ``DistributedSampler`` reads one global order whatever its replica count: the permutation
    of its seed and epoch (or the dataset's order), rank ``r`` taking positions ``r, r + n, ...``;
    so the data ranks' ``k``-th batches together are positions ``k * B .. (k + 1) * B - 1`` of
    that order (``B`` = per-rank batch x replicas, the global batch or micro-batch). A position
    counted in those global samples is therefore the same point of the run at any data size.
    """
    from torch.utils.data import RandomSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    batch, sampler = loader.batch_size, loader.sampler
    if batch is None:
        return None, None
    if isinstance(sampler, DistributedSampler):
        order = {"kind": "distributed", "shuffle": bool(sampler.shuffle), "seed": int(sampler.seed)}
        order["drop_last"] = bool(sampler.drop_last)
        return order, batch * int(sampler.num_replicas)
    if isinstance(sampler, SequentialSampler):
        return {"kind": "sequential"}, batch
    if isinstance(sampler, RandomSampler):
        return {"kind": "random"}, batch
    return None, None


def _same_order(saved: dict[str, Any] | None, mine: dict[str, Any] | None) -> bool:
    """Whether two loaders read the same global order (a DistributedSampler that does not shuffle
    reads the dataset's order, as a SequentialSampler does; a RandomSampler's order is its own)."""
    if not isinstance(saved, dict) or mine is None:
        return False

    def plain(order):
        if order.get("kind") == "distributed" and not order.get("shuffle"):
            return {"kind": "sequential"}
        return {k: v for k, v in order.items() if k != "drop_last"}

    return plain(saved) == plain(mine)


def describe_order(order: dict[str, Any] | None) -> str:
    """A sample order in words, for the note that a data position did not carry over."""
    if not isinstance(order, dict):
        return "a custom sampler's order"
    kind = order.get("kind")
    if kind == "distributed":
        how = f"shuffled with seed {order.get('seed')}" if order.get("shuffle") else "in the dataset's order"
        return f"the DistributedSampler's global order ({how})"
    if kind == "random":
        return "a RandomSampler's own shuffle"
    if kind == "sequential":
        return "the dataset's order"
    return repr(order)


def other_order(loader: Any, saved: dict[str, Any] | None) -> str | None:
    """Why ``loader`` cannot continue the ``saved`` position at all, or None when it can try.

    It cannot when it reads another global sample order (another sampler: a plain shuffling
    DataLoader in one process after a run under a plan, a sampler of another seed), or when it has
    no index to resume at (an IterableDataset). Those are not errors of a resume but another use of
    the checkpoint (evaluate, export, fine-tune elsewhere): the weights still load, the loader is
    left as given. A loader of the same order whose batches do not fit is :func:`resume_batches`'s
    ConfigError instead: there the user meant to continue the run.
    """
    if not can_resume(loader):
        kind = type(getattr(loader, "dataset", loader)).__name__
        return f"the loader ({kind}) has no index to resume at"
    if not isinstance(saved, dict):
        return "the checkpoint holds no data position (saved with loader=None)"
    if "samples" not in saved:
        return None
    order, _ = order_of(loader)
    saved_order = saved.get("order")
    if (saved_order or {}).get("kind") == (order or {}).get("kind") == "random" or _same_order(saved_order, order):
        return None
    return f"the loader reads {describe_order(order)}; the run saved a position in {describe_order(saved_order)}"


def resume_batches(loader: DataLoader, saved: dict[str, Any]) -> int:
    """How many of its batches ``loader`` skips to continue the saved position; ConfigError if it cannot.

    With the saved split (the same global samples per batch) it is the saved batch count: the
    bitwise path. At another split (the global batch divided into other micro-batches) the skip
    is derived from the global samples consumed, which is exact only if both loaders read the same
    global order and the samples fill whole batches; otherwise resuming would repeat or skip
    samples, and that is refused rather than done silently.
    """
    order, per_batch = order_of(loader)
    if "samples" not in saved:  # a position saved before positions counted samples: its batch count
        return int(saved.get("batches", 0))
    saved_order = saved.get("order")
    both_random = (saved_order or {}).get("kind") == (order or {}).get("kind") == "random"
    if not (both_random or _same_order(saved_order, order)):  # random: replayed from its generator's state
        raise ConfigError(
            "loader sample order",
            order,
            f"the saved run's order {saved_order}: a plan applied under a process group (torchrun, "
            "composable_atorch launch) reads it at any world size; or load_state without exact_resume=True (the "
            "weights load, the loader starts its epoch anew)",
        )
    if saved.get("per_batch") == per_batch:
        return int(saved.get("batches", 0))
    samples = saved["samples"]
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise ConfigError("saved data position samples", samples, "an integer >= 0")
    if per_batch is None or samples % per_batch:
        raise ConfigError(
            "loader batch at resume",
            per_batch,
            f"a global (micro-)batch dividing the {samples} samples already consumed this epoch "
            f"(saved with {saved.get('per_batch')} per batch)",
        )
    return samples // per_batch


class _SkipFirst:
    """An index sampler that drops its first ``k`` index batches once, then behaves as ``base``.

    The skip happens when an iterator is first advanced (or primed), so the DataLoader's unused
    extra ``iter()`` calls, and later passes of persistent workers, do not skip again.
    """

    def __init__(self, base, k: int):
        self.base, self.k, self.last = base, k, None

    def __len__(self):
        return max(0, len(self.base) - self.k)

    def __iter__(self):
        self.last = _Skipping(self, iter(self.base))
        return self.last


class _Skipping:
    def __init__(self, owner: _SkipFirst, it):
        self.owner, self.it = owner, it

    def prime(self) -> None:
        for _ in range(self.owner.k):
            next(self.it, None)
        self.owner.k = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.owner.k:
            self.prime()
        return next(self.it)


class _Counting:
    """The DataLoader's iterator, counting the batches it hands out into the loader's position."""

    def __init__(self, inner, position: DataPosition):
        self._inner, self._position = inner, position

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._inner)
        self._position.batches += 1
        return batch

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _resumable_class(base: type) -> type:
    """A subclass of the loader's class that tracks the data position (created once per class).

    Made by a factory rather than a mixin: a mixin placed before DataLoader in the bases gives
    a different object layout, and CPython then refuses the in-place ``__class__`` swap.
    """

    class Resumable(base):
        """``base`` that tracks its data position; see the module docstring."""

        __slots__ = ()  # the same object layout as ``base``, so the class can be swapped in place
        _ca_resumable = True
        _ca_skip = 0

        @property
        def position(self) -> DataPosition:
            return self.__dict__["_ca_position"]

        @property
        def epoch(self) -> int:
            """The epoch of the current (or, after resume_at, the resumed) pass."""
            pending = self.position.pending
            return pending["epoch"] if pending else self.position.epoch

        @property
        def batches_consumed(self) -> int:
            pending = self.position.pending
            return pending["batches"] if pending else self.position.batches

        @property
        def _index_sampler(self):
            base = super()._index_sampler
            return _SkipFirst(base, self._ca_skip) if self._ca_skip else base

        def resume_at(self, saved: dict[str, Any], *, rng: dict | None = None, replay: bool = True) -> None:
            """Make the next pass continue a saved position (``DataPosition.to_json()``).

            With ``replay`` the RNG states of the start of the saved pass are put back first, so the
            pass shuffles and seeds its workers as it did; ``rng`` (the states at the save) is put
            back once the pass is set up. Without ``replay`` (another world size) the epoch and the
            global samples consumed carry over (:func:`resume_batches`): per-rank RNG states do not.
            """
            epoch, batches = int(saved["epoch"]), resume_batches(self, saved)
            pass_rng = saved["pass_rng"] if replay else None
            self.position.pending = {
                "epoch": epoch,
                "batches": batches,
                "passes": int(saved["passes"]),
                "pass_rng": pass_rng,
                "rng": rng,
            }
            sampler = _epoch_sampler(self)
            if sampler is not None:
                sampler.set_epoch(int(epoch))

        def __iter__(self):
            position = self.position
            resume, position.pending = position.pending, None
            self._ca_skip = _start_pass(self, position, resume)
            try:
                inner = super().__iter__()
                _skip_now(inner)
            finally:
                self._ca_skip = 0
            if resume is not None and resume["rng"] is not None:
                restore_rng(resume["rng"])  # the states of the moment of the save, once the pass is set up
            return _Counting(inner, position)

    Resumable.__name__ = Resumable.__qualname__ = f"Resumable{base.__name__}"
    return Resumable


def _pass_rng(loader: DataLoader) -> dict[str, Any]:
    """The RNG states a pass starts from (global, and the loader's own generators by role): what a
    resumed pass puts back to shuffle and seed its workers as the saved pass did."""
    return {
        "global": capture_rng(),
        "generators": {k: _bytes_of(g.get_state()) for k, g in _generators(loader).items()},
    }


def _replay_pass_start(loader: DataLoader, pass_rng: dict[str, Any]) -> None:
    """Put back what :func:`_pass_rng` recorded at the start of the saved pass (a generator this
    loader does not have is skipped)."""
    restore_rng(pass_rng["global"])
    gens = _generators(loader)
    for role, text in pass_rng["generators"].items():
        if role in gens:
            gens[role].set_state(_state_of(text))


def _start_pass(loader: DataLoader, position: DataPosition, resume: dict[str, Any] | None) -> int:
    """Record a new pass in ``position``; returns the batches it skips (0 unless it resumes).

    A resumed pass (``resume``: what resume_at left pending) first replays the saved pass's start
    (its RNG states, when the saved ones apply here, and its sampler epoch), so it draws the same
    order; its epoch and pass count are the saved ones. A fresh pass takes the sampler's epoch
    (set by the user's ``set_epoch``), or without such a sampler its pass index.
    """
    sampler = _epoch_sampler(loader)
    skip = 0
    if resume is not None:
        if resume["pass_rng"] is not None:
            _replay_pass_start(loader, resume["pass_rng"])
        if sampler is not None:
            sampler.set_epoch(resume["epoch"])
        skip = resume["batches"]
    position.pass_rng = _pass_rng(loader)
    position.order, position.per_batch = order_of(loader)
    position.passes = position.passes + 1 if resume is None else max(1, resume["passes"])
    if resume is not None:
        position.epoch = resume["epoch"]
    else:
        position.epoch = int(getattr(sampler, "epoch", 0)) if sampler is not None else position.passes - 1
    position.batches = skip
    return skip


def _skip_now(inner) -> None:
    """Prime a resumed pass's skip as soon as the DataLoader's iterator exists: the index sampler
    then draws what the saved pass drew before the save (a RandomSampler's seed...) from the
    replayed states, before the states of the moment of the save are put back."""
    index_sampler = getattr(inner, "_index_sampler", None)
    if isinstance(index_sampler, _SkipFirst) and index_sampler.last is not None:
        index_sampler.last.prime()


_CLASSES: dict[type, type] = {}


def can_resume(loader: Any) -> bool:
    """True for a map-style DataLoader (an IterableDataset has no index to resume at)."""
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


def is_resumable(loader: Any) -> bool:
    return getattr(type(loader), "_ca_resumable", False)


def resumable(loader: DataLoader) -> DataLoader:
    """Make ``loader`` track its data position, in place; returns the same object.

    Idempotent. Plans apply it to the loader they return, so ``save_state`` works on it as is.
    """
    if is_resumable(loader):
        return loader
    if not can_resume(loader):
        kind = (
            type(getattr(loader, "dataset", None)).__name__ if isinstance(loader, DataLoader) else type(loader).__name__
        )
        raise ConfigError(
            "loader",
            kind,
            "a torch DataLoader over a map-style Dataset (its position is an index; an IterableDataset "
            "cannot be resumed at a batch), or loader=None to save no data position",
        )
    cls = type(loader)
    if cls not in _CLASSES:
        _CLASSES[cls] = _resumable_class(cls)
    loader.__class__ = _CLASSES[cls]
    order, per_batch = order_of(loader)
    loader.__dict__["_ca_position"] = DataPosition(order=order, per_batch=per_batch)
    return loader

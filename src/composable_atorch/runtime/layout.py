"""The parallel context: ATorch's ``parallel_mode`` layout, its device mesh, and its process groups.

ATorch writes a layout as ``[(name, size), ...]`` with the *first* name varying fastest over the
ranks: ``[("tensor", 4), ("pipeline", 2), ("data", 2)]`` at world 16 gives tensor groups
``[0..3], [4..7], ...``, pipeline groups ``[0, 4], [1, 5], ...`` and data groups ``[0, 8], [1, 9], ...``.
A torch :class:`~torch.distributed.device_mesh.DeviceMesh` varies its *last* dimension fastest, so
the mesh's dimensions are ATorch's list reversed (``("data", "pipeline", "tensor")``).

:func:`plan_layout` is the pure part (world size -> groups of ranks per dimension, with ATorch's
data-size adjustment), testable without processes. :func:`composable_atorch.runtime.mesh.make_context`
adds the device mesh when a process group exists. Nothing here is global: the context travels in
``TrainState.parallel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from composable_atorch.errors import ConfigError
from composable_atorch.runtime.axes import AXES

#: The dimension names ATorch supports, from the declared axes (:mod:`.axes`): ``zero`` is a ZeRO
#: sharding subgroup of data parallelism; ``context`` and ``sequence`` split every sequence (their ranks
#: read the same samples); ``expert`` splits MoE experts and is a batch dimension for everything else.
DIM_NAMES = tuple(a.name for a in AXES)
#: Dimensions over which different ranks see different samples (the batch is split over them).
BATCH_DIMS = tuple(a.name for a in AXES if a.batch)
#: Dimensions over which different ranks hold different tokens of the same samples (a sequence split).
SPLIT_DIMS = tuple(a.name for a in AXES if a.split)
#: ATorch's multiple parallel instances: the outermost (slowest) mesh dimension, one independent
#: copy of the layout per index; nothing is synchronized over it (every instance trains its own model).
INSTANCE_DIM = "instance"
#: Other names ATorch's parallel groups use for the same dimensions.
DIM_ALIASES = {"model": "tensor", "pipe": "pipeline", "expert_fsdp": "data"}


@dataclass(frozen=True)
class Layout:
    """Sizes per named dimension (ATorch's order, fastest first) and the rank order, for one world size."""

    dims: tuple[tuple[str, int], ...]
    world_size: int
    rank_order: tuple[int, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    def size(self, name: str) -> int:
        """Size of a dimension; 1 for a dimension the layout does not have."""
        return dict(self.dims).get(name, 1)

    @property
    def batch_split(self) -> int:
        """How many ways the global batch is split (the product of the data-like dimensions)."""
        return math.prod(self.size(n) for n in BATCH_DIMS)

    # torch's mesh order: ATorch's list reversed (the last mesh dimension varies fastest)
    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(reversed(self.names))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in reversed(self.dims))

    def mesh_tensor(self):
        import torch

        return torch.tensor(self.rank_order, dtype=torch.int).reshape(self.mesh_shape)

    def groups(self, name: str) -> list[list[int]]:
        """The groups of ranks along one dimension, ordered as ATorch's 16-rank example lists them."""
        if name not in self.names:
            raise ConfigError("parallel dimension", name, f"one of the layout's dimensions {self.names}")
        mesh = self.mesh_tensor()
        axis = self.mesh_dim_names.index(name)
        rows = mesh.movedim(axis, -1).reshape(-1, self.size(name))
        return [list(map(int, row)) for row in rows]

    def coordinate(self, rank: int, name: str) -> int:
        """This rank's index inside its group along ``name`` (0 for an absent dimension)."""
        if name not in self.names:
            return 0
        for group in self.groups(name):
            if rank in group:
                return group.index(rank)
        raise ConfigError("rank", rank, f"a rank below the world size {self.world_size}")

    def batch_rank(self, rank: int) -> int:
        """This rank's index among the ``batch_split`` data shards (data-major over data x zero x expert)."""
        inner = self.coordinate(rank, "data") * self.size("zero") + self.coordinate(rank, "zero")
        return inner * self.size("expert") + self.coordinate(rank, "expert")

    def describe(self) -> str:
        dims = " x ".join(f"{n} {s}" for n, s in self.dims)
        order = "" if self.rank_order == tuple(range(self.world_size)) else f", rank order {list(self.rank_order)}"
        return f"{dims} = world {self.world_size}{order}"


def _arith(dims) -> str:
    return " x ".join(f"{n} {s}" for n, s in dims) or "(no dimensions)"


def normalize_groups(groups: Any, field_name: str = "parallel_mode.groups") -> tuple[tuple[str, int], ...]:
    """Validate ATorch's ``[(name, size), ...]`` and return it as a tuple of pairs."""
    if isinstance(groups, str) or not isinstance(groups, list | tuple) or not groups:
        raise ConfigError(field_name, groups, "a non-empty list of (name, size) pairs, e.g. [('data', 2)]")
    out: list[tuple[str, int]] = []
    for item in groups:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise ConfigError(field_name, item, "(name, size) pairs such as ('tensor', 2)")
        name, size = item
        name = DIM_ALIASES.get(name, name) if isinstance(name, str) else name
        if name not in DIM_NAMES:
            aliases = ", ".join(f"{a} (= {c})" for a, c in DIM_ALIASES.items())
            raise ConfigError(f"{field_name} name", name, f"one of {', '.join(DIM_NAMES)}, or ATorch's {aliases}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{field_name} size of {name!r}", size, "an integer >= 1")
        if name in (n for n, _ in out):
            raise ConfigError(field_name, name, "each dimension named once")
        out.append((name, size))
    return tuple(out)


def plan_layout(groups: Any, world_size: int, rank_order: Any = None, instances: bool = False) -> Layout:
    """The layout for ``world_size``: data size adjusted as ATorch describes, or a ConfigError.

    With a ``data`` dimension its size becomes ``world / (product of the others)`` (ATorch's
    ``[("data", 8)]`` at world 16 -> 16). Without one the sizes must multiply to the world size.
    ``instances`` (ATorch's multiple parallel instances): the sizes are kept as given and
    ``world / product`` independent copies of the layout fill the world, as an outermost
    ``instance`` dimension (ATorch's ``parallel_instance_index`` is ``rank // product``).
    """
    dims = normalize_groups(groups)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world size", world_size, "an integer >= 1")
    if instances:
        size = math.prod(s for _, s in dims)
        if world_size % size:
            raise ConfigError(
                "parallel_mode.groups",
                list(dims),
                f"sizes whose product divides the world size for multiple instances: {_arith(dims)} = {size}, "
                f"and {world_size} / {size} is not an integer",
            )
        if world_size > size:
            dims = (*dims, (INSTANCE_DIM, world_size // size))
        return Layout(dims=dims, world_size=world_size, rank_order=_rank_order(rank_order, world_size))
    others = [(n, s) for n, s in dims if n != "data"]
    fixed = math.prod(s for _, s in others)
    if any(n == "data" for n, _ in dims):
        if world_size % fixed:
            raise ConfigError(
                "parallel_mode.groups",
                list(dims),
                f"sizes whose non-data product divides the world size: {_arith(others)} = {fixed}, "
                f"and {world_size} / {fixed} is not an integer, so no data size fits; {refit_hint(others, world_size)}",
            )
        dims = tuple((n, world_size // fixed if n == "data" else s) for n, s in dims)
    elif fixed != world_size:
        raise ConfigError(
            "parallel_mode.groups",
            list(dims),
            f"sizes multiplying to the world size: {_arith(dims)} = {fixed}, not {world_size}; "
            "add ('data', n) to let the data size absorb the rest",
        )
    return Layout(dims=dims, world_size=world_size, rank_order=_rank_order(rank_order, world_size))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_model_degrees(others, world_size: int) -> tuple[tuple[str, int], ...]:
    """The model-parallel sizes closest to ``others`` whose product divides ``world_size``.

    Each size shrinks to one of its divisors (a divisor of a tensor degree still divides the head
    counts, fewer pipeline stages still cut the same blocks); the largest product wins (the per-rank
    memory closest to the planned one), ties to the earlier (faster-varying) dimensions kept larger.
    Not applied by itself: the model-parallel sizes are the user's memory plan, so a world they do
    not divide is a ConfigError that names this layout and the world sizes that keep the plan.
    """
    best: tuple = ()
    best_key = None
    combos = [()]
    for name, size in others:
        combos = [(*c, (name, d)) for c in combos for d in _divisors(size)]
    for combo in combos:
        product = math.prod(d for _, d in combo)
        if world_size % product:
            continue
        key = (product, tuple(d for _, d in combo))
        if best_key is None or key > best_key:
            best, best_key = combo, key
    return best


def refit_hint(others, world_size: int) -> str:
    """What would fit: the nearest model-parallel sizes at this world, or the world sizes that keep them."""
    fixed = math.prod(s for _, s in others)
    below, above = world_size // fixed * fixed, (world_size // fixed + 1) * fixed
    worlds = " or ".join(str(w) for w in (below, above) if w >= 1)
    nearest = nearest_model_degrees(others, world_size)
    data = world_size // math.prod(d for _, d in nearest)
    return (
        f"at world {world_size} the nearest layout is {_arith((*nearest, ('data', data)))} (give those sizes), "
        f"or run at world {worlds} (a multiple of {fixed}) to keep {_arith(others)}"
    )


def refit_note(given, layout: Layout) -> str | None:
    """explain()'s line for a data size refitted to the world (None when nothing changed)."""
    given = dict(given)
    if given.get("data") == layout.size("data") or "data" not in given or given == {"data": 1}:
        return None  # nothing given, or parallel_mode()'s default (data takes the world): no refit to tell
    kept = _arith([(n, s) for n, s in layout.dims if n != "data"])
    return (
        f"refitted to world {layout.world_size}: data {given['data']} -> {layout.size('data')}"
        + (f", {kept} kept as given" if kept != "(no dimensions)" else "")
        + f" ({layout.describe()}); the same global batch is split over {layout.batch_split} data rank(s)"
    )


def _rank_order(rank_order: Any, world_size: int) -> tuple[int, ...]:
    if rank_order is None:
        return tuple(range(world_size))
    order = tuple(rank_order)
    if sorted(order) != list(range(world_size)) or any(isinstance(r, bool) for r in order):
        raise ConfigError(
            "parallel_mode.rank_order", rank_order, f"a permutation of the ranks 0..{world_size - 1}, or None"
        )
    return order

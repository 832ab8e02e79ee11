"""The environment a plan is checked against, as an explicit value.

compose() accepts an :class:`Environment` so a plan can be checked against hardware we do not
have (``Environment(world_size=16, device="cuda", compute_capability=(9, 0))``) on this CPU;
without one it calls :func:`Environment.detect`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

#: Optional packages whose presence changes what a plan can do.
OPTIONAL_PACKAGES = (
    "deepspeed",
    "fairscale",
    "torchao",
    "transformer_engine",
    "flash_attn",
    "transformers",
    "peft",
    "optuna",
)

# Packages whose mere presence on disk is not enough: they must import. transformer-engine's base
# package installs without its torch part and then raises RuntimeError on import.
_MUST_IMPORT = frozenset({"transformer_engine", "flash_attn"})


@functools.cache
def package_available(name: str) -> bool:
    """True when ``name`` can be used; never raises, whatever the package does on import.

    Cached: compose() detects the environment on every call, and a broken package (transformer
    engine without its torch part) would otherwise be imported, and fail, every time.
    """
    try:
        if importlib.util.find_spec(name) is None:
            return False
    except (ImportError, ValueError):
        return False
    if name in _MUST_IMPORT:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken install is an absent package
            return False
    return True


#: ``(logger, text in the message)`` of log lines optional packages print about themselves on import.
#: transformers imports torchao (its quantizer registry) whenever torchao is installed, so any command
#: that builds a transformers model printed them, fp8 or not:
#: * torchao's "Failed to load <its _C*.so>": prebuilt kernels that cannot load here (a wheel's
#:   extension for another CPython, CUTLASS sm90 / mxfp8 kernels with a CPU-only torch). Harmless for
#:   this library: its fp8 step is torchao.float8's Float8Linear (torch._scaled_mm or emulation), which
#:   calls none of them; where they load, nothing is printed anyway;
#: * torch's pytree warning that torchao registers its Enums (KernelPreference, ScaleCalculationMode)
#:   through a deprecated call: torchao's to fix, nothing a user can act on.
IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _DropImportNoise(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_imports():
    """Hold back :data:`IMPORT_NOISE` while the block runs (the CLI's commands, fp8's torchao import);
    every other line of those loggers still prints."""
    added = [(logging.getLogger(name), _DropImportNoise(text)) for name, text in IMPORT_NOISE]
    for logger, f in added:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in added:
            logger.removeFilter(f)


@dataclass(frozen=True)
class Environment:
    """World size, device kind, compute capability, installed optional packages, and nodes.

    ``nodes``: how many machines the world spans (``processes_per_node = world_size / nodes``, read
    from torchrun's ``LOCAL_WORLD_SIZE`` by :meth:`detect`). Hybrid sharding shards inside a node and
    replicates across nodes, so plans and costs read it: ``Environment(world_size=64, nodes=8, device="cuda")``.

    ``hardware``: the accelerator the plan is meant for, a catalog name (``"h100-sxm"``), a
    declaration file or a :class:`~composable_atorch.hardware.Hardware` (kept as the Hardware; an
    unknown name is a HardwareError naming the nearest). Its compute capability becomes the
    environment's when none is given, so ``Environment(device="cuda", hardware="h100-sxm")`` checks
    fp8 plans as an sm90 card would.
    """

    world_size: int = 1
    device: str = "cpu"
    compute_capability: tuple[int, int] | None = None
    packages: frozenset[str] = field(default_factory=frozenset)
    nodes: int = 1
    hardware: Any = None

    def __post_init__(self):
        from composable_atorch.errors import ConfigError
        from composable_atorch.hardware import resolve

        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("Environment.world_size", self.world_size, "an integer >= 1")
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ConfigError("Environment.nodes", self.nodes, "an integer >= 1")
        if isinstance(self.world_size, int) and self.world_size % self.nodes:
            raise ConfigError(
                "Environment.nodes",
                self.nodes,
                f"a divisor of the world size {self.world_size} (every node runs the same number of processes)",
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError("Environment.device", self.device, "'cpu' or 'cuda'")
        if self.hardware is not None:
            object.__setattr__(self, "hardware", resolve(self.hardware))
            if self.compute_capability is None and self.device == "cuda":
                object.__setattr__(self, "compute_capability", self.hardware.compute_capability)
        if self.compute_capability is not None:
            object.__setattr__(self, "compute_capability", tuple(self.compute_capability))
        object.__setattr__(self, "packages", frozenset(self.packages))

    @property
    def processes_per_node(self) -> int:
        """Ranks on one machine (torchrun's ``LOCAL_WORLD_SIZE``)."""
        return self.world_size // self.nodes

    def has(self, package: str) -> bool:
        return package in self.packages

    def with_(self, **changes) -> Environment:
        """A copy with some fields changed, e.g. ``env.with_(world_size=2)``.

        A new world size keeps the processes per node (the machines' shape) where it divides, else one node."""
        if "world_size" in changes and "nodes" not in changes and self.nodes > 1:
            world, per = changes["world_size"], self.processes_per_node
            changes["nodes"] = world // per if isinstance(world, int) and world >= per and world % per == 0 else 1
        return replace(self, **changes)

    def describe(self) -> str:
        cc = "" if self.compute_capability is None else f" sm{self.compute_capability[0]}{self.compute_capability[1]}"
        pkgs = ", ".join(sorted(self.packages)) or "none"
        nodes = f" ({self.nodes} nodes x {self.processes_per_node} processes)" if self.nodes > 1 else ""
        hw = f" ({self.hardware.name})" if self.hardware is not None else ""
        return f"world {self.world_size}{nodes}, {self.device}{hw}{cc}, optional packages: {pkgs}"

    @staticmethod
    def detect() -> Environment:
        """Read the running process: torch.distributed (or torchrun's WORLD_SIZE), CUDA, packages, and the
        nodes (world / torchrun's LOCAL_WORLD_SIZE; one node when it is absent or does not divide the world)."""
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            device, cc = "cuda", torch.cuda.get_device_capability()
        else:
            device, cc = "cpu", None
        return Environment(
            world_size=world,
            device=device,
            compute_capability=cc,
            packages=frozenset(p for p in OPTIONAL_PACKAGES if package_available(p)),
            nodes=_nodes(world),
        )


def _nodes(world: int) -> int:
    """Nodes from torchrun's LOCAL_WORLD_SIZE (processes on this node); 1 when unknown or uneven."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return 1
    return world // local if 0 < local <= world and world % local == 0 else 1


#: glibc's malloc as a training process on the CPU wants it: blocks up to 32 MiB (glibc's largest
#: mmap threshold) come from the heap, and freed memory stays with the process (trim threshold
#: 16 GiB). By default glibc maps a large block fresh and returns freed heap to the system, so the
#: activations of every step are allocated on pages the kernel must fault in and zero again.
#: Measured on this project's 2-core CI machine (a user GPT, d 256, 4 blocks, 8 x 128 tokens per
#: rank): one process's bf16 step 158 -> 122 ms (18,000 page faults and 28 ms of kernel time per step
#: -> none), fp32 310 -> 290-307 ms; two DDP ranks' bf16 step 175 -> 155 ms. Torch's own CPU launcher
#: (``torch.backends.xeon.run_cpu``) swaps in jemalloc or tcmalloc for the same reason.
CPU_MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432", "glibc.malloc.trim_threshold=17179869184")
#: ``COMPOSABLE_ATORCH_MALLOC=default`` keeps glibc's own malloc settings in the ranks the library starts
MALLOC_ENV = "COMPOSABLE_ATORCH_MALLOC"
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def cpu_malloc_environment(environ=None) -> dict[str, str]:
    """``{"GLIBC_TUNABLES": ...}`` for the ranks the library starts (the launcher's, a search's trials)
    on a machine without CUDA: :data:`CPU_MALLOC_TUNABLES` after whatever tunables ``environ`` already
    has. Empty where it does not apply: CUDA here (not measured there), not glibc, the user already set
    malloc's tunables or preloads another allocator (their choice wins), or :data:`MALLOC_ENV` is
    ``default``. Read at a process's start, so it goes into the environment a rank starts with."""
    import platform

    import torch

    environ = os.environ if environ is None else environ
    opted_out = environ.get(MALLOC_ENV, "").strip().lower() == "default"
    if opted_out or platform.libc_ver()[0] != "glibc" or torch.cuda.is_available():
        return {}
    current = environ.get("GLIBC_TUNABLES", "")
    preload = environ.get("LD_PRELOAD", "")
    if "glibc.malloc." in current or any(k in environ for k in _MALLOC_SETTINGS) or "malloc" in preload:
        return {}
    return {"GLIBC_TUNABLES": ":".join([t for t in current.split(":") if t] + list(CPU_MALLOC_TUNABLES))}

"""What the estimate needs to price a step on paper: the device, the nodes, the tokens, the result.

Kept apart from ``estimate/core.py`` (which composes and simulates) so the CPU path reads as before.
"""

from __future__ import annotations

from composable_atorch.errors import ConfigError
from composable_atorch.estimate.paper import price
from composable_atorch.estimate.paper.utilization import utilization
from composable_atorch.hardware import Hardware
from composable_atorch.hardware import resolve as resolve_hardware

#: the device priced when none is named and no GPU the catalog knows is here
DEFAULT_HARDWARE = "h100-sxm"


def target_hardware(hardware) -> Hardware:
    """The Hardware to price on: as given (name, file, dict or Hardware), else this machine's GPU
    where the catalog knows it (with its calibration where one was measured), else the default."""
    if hardware is not None:
        return resolve_hardware(hardware)
    import torch

    if torch.cuda.is_available():
        found = calibrated_hardware()
        if found is not None:
            return found
    return resolve_hardware(DEFAULT_HARDWARE)


def check_nodes(nodes, world_size: int, hw: Hardware | None) -> int:
    """The nodes the world spans: as given, else the world over the hardware's devices per node."""
    if nodes is None:
        per = hw.devices_per_node if hw is not None else world_size
        nodes = max(1, -(-world_size // per))
        if world_size % nodes:
            raise ConfigError(
                "nodes", None, f"the number of machines the {world_size} ranks span (it must divide the world size)"
            )
        return nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ConfigError("nodes", nodes, f"a positive divisor of the world size {world_size}")
    return nodes


def tokens_of(batch, global_batch: int) -> int:
    """Tokens of the global step: the batch times the elements of one sample of its first leaf."""
    from composable_atorch.estimate.inputs import leaves

    first = next(x for x in leaves(batch) if (len(x) if not hasattr(x, "dim") else x.dim()) >= 1)
    shape = tuple(first.shape) if hasattr(first, "shape") else tuple(first)
    per_sample = 1
    for d in shape[1:]:
        per_sample *= int(d)
    return global_batch * per_sample


def paper_step(runs, setting, model, batch, global_batch: int, notes: list, extra: dict):
    """The priced step of the simulated ranks (:mod:`.paper`), its StepTime and its Utilization."""
    from composable_atorch.estimate.paper.utilization import attention_flops, lookup_free_params
    from composable_atorch.estimate.steptime import StepTime

    hw = setting.hardware
    total = price.step([r.paper for r in runs], setting, runs[0].micro_batches)
    dtype = runs[0].paper.matmul_dtype
    usage = utilization(
        seconds=total.seconds,
        world=setting.world,
        tokens=tokens_of(batch, global_batch),
        params=lookup_free_params(model),
        attention_per_stage=[attention_flops(r.trace.ops) for r in runs],
        flops_per_stage=[float(r.trace.flops()) for r in runs],
        peak=hw.peak(dtype),
        peak_dtype=dtype,
    )
    timing = StepTime(total.seconds, total.compute, total.comm, total.overhead, total.bubble)
    notes.append(
        f"step time on paper: {hw.name} x {setting.world} ({setting.nodes} node{'s' if setting.nodes > 1 else ''}): "
        f"compute {total.compute:.4f} s, exposed comm {total.comm:.4f} s of {total.comm_total:.4f} s, "
        f"overhead {total.overhead:.4f} s"
        + (f", pipeline bubble {total.bubble:.4f} s ({setting.schedule})" if total.bubble else "")
        + (", compile's fusion applied" if setting.compiled else "")
    )
    extra["paper"] = {"hardware": hw.name, "nodes": setting.nodes, **total.to_dict(), **usage.to_dict()}
    return timing, usage


def calibrated_hardware():
    """This machine's GPU (a ``hardware.Hardware``): its stored calibration where there is one, else its catalog
    entry, else None."""
    import torch

    from composable_atorch.estimate.calibrate import CalibrationError, gpu_cache_path, load
    from composable_atorch.estimate.paper.calibrate import as_hardware
    from composable_atorch.hardware import HardwareError, for_device_name

    name = torch.cuda.get_device_name()
    base = for_device_name(name)
    if base is None:
        return None
    path = gpu_cache_path(name)
    if not path.exists():
        return base
    try:
        return as_hardware(load(path), base)
    except (CalibrationError, HardwareError):
        return base  # an unusable file: the paper figures, as without one

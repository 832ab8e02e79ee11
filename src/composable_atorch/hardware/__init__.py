"""Accelerators as data: what the paper step-time model prices a plan's simulated step with.

    from composable_atorch.hardware import get, resolve, Hardware
    h100 = get("h100-sxm")                 # the catalog (:mod:`.catalog`), every figure sourced
    mine = resolve("cluster.toml")         # a declaration file, read as untrusted data (:mod:`.declare`)
    a100 = get("a100").with_network(12.5e9, "800 Gb/s RDMA per node of 8")

A leaf package (it imports only ``errors``, ``units`` and ``untrusted``), so the ``Environment``
can hold a device and every layer can read one.
"""

from __future__ import annotations

from composable_atorch.hardware.catalog import CATALOG, for_device_name, get, names
from composable_atorch.hardware.declare import from_dict, load, resolve
from composable_atorch.hardware.spec import DTYPES, Efficiency, Hardware, HardwareError, Link, Table, flat

__all__ = [
    "CATALOG",
    "DTYPES",
    "Efficiency",
    "Hardware",
    "HardwareError",
    "Link",
    "Table",
    "flat",
    "for_device_name",
    "from_dict",
    "get",
    "load",
    "names",
    "resolve",
]

"""The named accelerators, every figure with its source beside it.

Peaks are dense (no 2:4 sparsity: datasheets print the sparse figure first, twice the dense one).
Memory in GiB as the cards report it (nvidia-smi's MiB). Link bandwidth is per device and direction:
NVLink's datasheet figure is both directions added, so half of it. The network is a common system's
default (HGX / DGX: one NIC per GPU); a cluster with another network overrides it
(``Hardware.with_network`` or a declaration's ``network``).

    from composable_atorch.hardware import get, names
    get("h100-sxm").peak("bfloat16")  # 989.4e12
"""

from __future__ import annotations

import difflib

from composable_atorch.hardware import curves as c
from composable_atorch.hardware.spec import Hardware, HardwareError, Link

GiB = 2**30
#: one kernel's floor on NVIDIA GPUs: the launch and the first wave's ramp
LAUNCH_NVIDIA = (3e-6, "kernel launch floor ~3 us per kernel on A100/H100-class GPUs (CUDA launch overhead, a few us)")
LAUNCH_AMD = (5e-6, "assumed: HIP kernel launch floor ~5 us (above CUDA's)")

A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (2021)"
H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5"
H100P_DS = "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe"
H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024)"
B200_DS = "NVIDIA HGX B200 datasheet (2024), per GPU of 8 (sparse figures halved)"
L4_DS = "NVIDIA L4 Tensor Core GPU datasheet (2023)"
MI300X_DS = "AMD Instinct MI300X accelerator datasheet (2023)"
NET_HDR = "DGX A100: 8 x 200 Gb/s ConnectX-6 HDR InfiniBand, one per GPU (25 GB/s)"
NET_NDR = "DGX/HGX H100, H200, B200: 8 x 400 Gb/s ConnectX-7 NDR, one per GPU (50 GB/s)"


def _net(gbit: float, source: str) -> Link:
    return Link(gbit * 1e9 / 8, "network", c.NETWORK, source)


def _device(
    name: str,
    datasheet: str,
    peaks: dict[str, float],
    memory_gib: float,
    bandwidth: float,
    intra: Link,
    network: Link,
    gemm: dict,
    attention: dict,
    cc: tuple[int, int],
    launch=LAUNCH_NVIDIA,
    notes: dict | None = None,
) -> Hardware:
    sources = {f"peak_flops.{k}": datasheet for k in peaks}
    sources.update(
        {
            "memory_bytes": datasheet,
            "memory_bandwidth": datasheet,
            "launch_s": launch[1],
            "intra.bandwidth": intra.source,
            "network.bandwidth": network.source,
            "memory": c.HBM.source,
            "compute_capability": f"CUDA compute capability of {name} (torch.cuda.get_device_capability)",
        }
    )
    sources.update({f"gemm.{k}": v.source for k, v in gemm.items()})
    sources.update({f"attention.{k}": v.source for k, v in attention.items()})
    sources.update(notes or {})
    return Hardware(
        name=name,
        peak_flops=peaks,
        memory_bytes=memory_gib * GiB,
        memory_bandwidth=bandwidth,
        launch_s=launch[0],
        intra=intra,
        network=network,
        gemm=gemm,
        attention=attention,
        memory=c.HBM,
        compute_capability=cc,
        sources=sources,
    )


def _ampere_gemm(frac: float, device: str) -> dict:
    g = c.mamf(frac, device)
    return {
        "bfloat16": g,
        "float16": g,
        "tfloat32": c.assumed(frac, f"tf32 at the bf16 MAMF fraction of {device}"),
        "float32": c.assumed(frac, f"fp32 at the bf16 MAMF fraction of {device}"),
    }


def _with_fp8(gemm: dict, frac: float, device: str, source: str | None = None) -> dict:
    fp8 = c.mamf(frac, device, "fp8") if source is None else c.assumed(frac, source)
    return {**gemm, "float8": fp8}


_A100 = {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}
_H100 = {"float32": 67e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12, "float8": 1978.9e12}
_H100_PCIE = {"float32": 51e12, "tfloat32": 378e12, "bfloat16": 756e12, "float16": 756e12, "float8": 1513e12}
_B200 = {"float32": 75e12, "tfloat32": 1125e12, "bfloat16": 2250e12, "float16": 2250e12, "float8": 4500e12}
_L4 = {"float32": 30.3e12, "tfloat32": 60e12, "bfloat16": 121e12, "float16": 121e12, "float8": 242.5e12}
_MI300X = {"float32": 163.4e12, "tfloat32": 653.7e12, "bfloat16": 1307.4e12, "float16": 1307.4e12, "float8": 2614.9e12}

NVLINK3 = Link(300e9, "nvlink", c.NVLINK3, "A100 NVLink 3: 600 GB/s both directions -> 300 GB/s per direction")
NVLINK4 = Link(450e9, "nvlink", c.NVLINK4, "H100/H200 NVLink 4: 900 GB/s both directions -> 450 GB/s per direction")
NVLINK5 = Link(
    900e9,
    "nvlink",
    c.collectives(0.80, 0.80, "assumed: NVLink 5 collectives at H100's all-gather fraction (no figure at hand)"),
    "B200 NVLink 5: 1.8 TB/s both directions -> 900 GB/s per direction",
)
PCIE5 = Link(64e9, "pcie", c.PCIE, "PCIe Gen5 x16: 128 GB/s both directions -> 64 GB/s per direction")
PCIE4 = Link(32e9, "pcie", c.PCIE, "PCIe Gen4 x16: 64 GB/s both directions -> 32 GB/s per direction")
XGMI = Link(
    448e9, "xgmi", c.XGMI, "MI300X Infinity Fabric: 7 peer links x 64 GB/s per direction (896 GB/s bidirectional)"
)

_A100_ATT = c.attention(c.FLASH_A100_FWD, c.FLASH_A100_BWD)
_H100_ATT = c.attention(c.FLASH_H100_FWD, c.FLASH_H100_BWD)
_ASSUMED_ATT = "assumed: attention fraction of the nearest measured device ({})"


def _att_like(base: dict, like: str) -> dict:
    return {k: c.scaled(v, 1.0, _ASSUMED_ATT.format(like) + "; " + v.source) for k, v in base.items()}


CATALOG: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        _device(
            "a100-40gb-sxm",
            A100_DS,
            _A100,
            40,
            1555e9,
            NVLINK3,
            _net(200, NET_HDR),
            _ampere_gemm(0.869, "A100 SXM"),
            _A100_ATT,
            (8, 0),
        ),
        _device(
            "a100-80gb-sxm",
            A100_DS,
            _A100,
            80,
            2039e9,
            NVLINK3,
            _net(200, NET_HDR),
            _ampere_gemm(0.869, "A100 SXM"),
            _A100_ATT,
            (8, 0),
        ),
        _device(
            "h100-sxm",
            H100_DS,
            _H100,
            80,
            3.35e12,
            NVLINK4,
            _net(400, NET_NDR),
            _with_fp8(_ampere_gemm(0.803, "H100 SXM"), 0.709, "H100 SXM"),
            _H100_ATT,
            (9, 0),
        ),
        _device(
            "h100-pcie",
            H100P_DS,
            _H100_PCIE,
            80,
            2.0e12,
            PCIE5,
            _net(400, "assumed: one 400 Gb/s NIC per GPU as on HGX (override for your system)"),
            _with_fp8(_ampere_gemm(0.803, "H100 SXM (no PCIe figure published)"), 0.709, "H100 SXM"),
            _att_like(_H100_ATT, "H100 SXM"),
            (9, 0),
        ),
        _device(
            "h200",
            H200_DS,
            _H100,
            141,
            4.8e12,
            NVLINK4,
            _net(400, NET_NDR),
            _with_fp8(_ampere_gemm(0.803, "H100 SXM ('H200 is the same')"), 0.734, "H200 SXM"),
            _att_like(_H100_ATT, "H100 SXM"),
            (9, 0),
        ),
        _device(
            "b200",
            B200_DS,
            _B200,
            180,
            8.0e12,
            NVLINK5,
            _net(400, NET_NDR),
            _with_fp8(_ampere_gemm(0.776, "B200 SXM"), 0.763, "B200 SXM"),
            _att_like(_H100_ATT, "H100 SXM"),
            (10, 0),
        ),
        _device(
            "l4",
            L4_DS,
            _L4,
            24,
            300e9,
            PCIE4,
            _net(100 / 8, "GCP g2-standard-96: 100 Gb/s per VM of 8 L4 (assumed default)"),
            _with_fp8(
                _ampere_gemm(0.811, "A100 PCIe (no L4 figure published)"),
                0.709,
                None,
                "fp8 at H100 SXM's MAMF fraction (no L4 figure published)",
            ),
            _att_like(_A100_ATT, "A100"),
            (8, 9),
        ),
        _device(
            "mi300x",
            MI300X_DS,
            _MI300X,
            192,
            5.3e12,
            XGMI,
            _net(400, "assumed: one 400 Gb/s NIC per GPU as on HGX-class MI300X platforms"),
            _with_fp8(
                _ampere_gemm(0.514, "MI300X (PYTORCH_TUNABLEOP_ENABLED=1)"),
                0.514,
                None,
                "fp8 at the bf16 MAMF fraction (MAMF table has no MI300X fp8 figure)",
            ),
            _att_like(_A100_ATT, "A100 (CK flash kernels)"),
            (9, 4),
            launch=LAUNCH_AMD,
        ),
    )
}

#: other spellings of the catalog's names
ALIASES = {
    "a100": "a100-80gb-sxm",
    "a100-80gb": "a100-80gb-sxm",
    "a100-40gb": "a100-40gb-sxm",
    "a100-sxm": "a100-80gb-sxm",
    "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h200-sxm": "h200",
    "b200-sxm": "b200",
    "mi300": "mi300x",
}


def names() -> list[str]:
    return sorted(CATALOG)


def get(name: str) -> Hardware:
    """The catalog's device ``name`` (or an alias); HardwareError naming the nearest names otherwise."""
    if not isinstance(name, str):
        raise HardwareError("hardware", name, f"a device name ({', '.join(names())}) or a Hardware")
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    near = difflib.get_close_matches(key, [*CATALOG, *ALIASES], n=3, cutoff=0.4)
    near = list(dict.fromkeys(ALIASES.get(n, n) for n in near))
    hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
    raise HardwareError("hardware", name, f"one of {', '.join(names())}{hint}")


#: substrings of torch.cuda.get_device_name() -> catalog name (first match wins)
DEVICE_NAMES = (
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("H200", "h200"),
    ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-40gb-sxm"),
    ("A100", "a100-80gb-sxm"),
    ("L4", "l4"),
    ("MI300X", "mi300x"),
)


def for_device_name(device_name: str) -> Hardware | None:
    """The catalog entry for a CUDA device name (``torch.cuda.get_device_name()``), or None."""
    for key, name in DEVICE_NAMES:
        if key.lower() in device_name.lower():
            return CATALOG[name]
    return None

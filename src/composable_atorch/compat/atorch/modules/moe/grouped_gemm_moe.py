"""``atorch.modules.moe.grouped_gemm_moe``: ATorch's grouped-GEMM MoE is not built here (see the package)."""

from __future__ import annotations

from composable_atorch.compat.atorch.modules.moe import _NotBuilt


class Grouped_GEMM_MoE(_NotBuilt):  # noqa: N801 - ATorch's name
    pass


class SwiGLUActivatition(_NotBuilt):  # ATorch's spelling
    pass


__all__ = ["Grouped_GEMM_MoE", "SwiGLUActivatition"]

"""``atorch.utils.util_func`` (some ATorch versions keep ``divide`` here)."""

from composable_atorch.compat.atorch.common.util_func import data_float_to_dtype, data_to_device, divide

__all__ = ["data_float_to_dtype", "data_to_device", "divide"]

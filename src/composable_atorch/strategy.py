"""Strategies as data: ``composable_atorch.strategy.load`` / ``dump`` (JSON, never pickle).

The code lives in :mod:`composable_atorch.core.strategy`; this module is its public name, so that
``import composable_atorch.strategy`` and ``from composable_atorch import strategy`` give the same
functions.
"""

from composable_atorch.core.strategy import allow, dump, load

__all__ = ["allow", "dump", "load"]

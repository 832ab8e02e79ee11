"""``atorch.utils.meta_model_utils``: meta-device model construction.

``record_module_init`` is the library's (ds_3d_parallel builds each stage's layers from it).
``init_empty_weights_with_disk_offload`` is ATorch's meta init that offloads the initial weights to
disk for its FSDP loader to read back; here it records the model the same way (nothing allocated,
nothing written), and the plan's steps build the modules they need from the records.
"""

from __future__ import annotations

import contextlib

from composable_atorch.runtime.record_init import build_recorded, is_meta, record_module_init


@contextlib.contextmanager
def init_empty_weights_with_disk_offload(
    ignore_tie_weights=False,
    include_buffers=True,
    reset=True,
    disk_offload=True,
    offload_path=None,
    ckpt_path=None,
    shard_kwargs=None,
    meta_init_offload_name=None,
):
    """A model built inside is on the meta device with its modules' constructor arguments recorded
    (:func:`record_module_init`); ATorch's offload arguments are accepted and write nothing."""
    with record_module_init():
        yield


__all__ = ["build_recorded", "init_empty_weights_with_disk_offload", "is_meta", "record_module_init"]

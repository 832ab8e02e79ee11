"""The data- and model-parallel families, one room each: ``data`` (parallel_mode, ddp, zero1,
zero2, fsdp and their DeepSpeed variants), ``tensor``, ``pipeline``, ``expert`` (MoE experts split,
all-to-all dispatch), ``mixed`` (tensor x pipeline x data in one step) and ``ds3d`` (DeepSpeed's
pipeline engine). The layers contract in ``pyproject.toml`` keeps ``data`` at the bottom and
``mixed`` / ``ds3d`` at the top.
"""

"""The DeepSpeed side of ``ds_3d_parallel``: its config derived from the plan, its topology, the stage
optimizer, exact clipping, and what ``train_step`` drives.

Kept apart from :mod:`.ds3d` (the transform and its contract) so each file reads in one sitting.
"""

from __future__ import annotations

import json
import os

from composable_atorch.core import untrusted
from composable_atorch.errors import ConfigError
from composable_atorch.runtime.optim import OptimizerHook


def frozen(value):
    """Lists as tuples, recursively: what a JSON round trip gives back (configs compare equal after it)."""
    if isinstance(value, dict):
        return {k: frozen(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(frozen(v) for v in value)
    return value


def _thawed(value):
    if isinstance(value, dict):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


_FIELD = "DeepSpeed3DParallelConfig.ds_config"


def check_ds_config_path(value) -> None:
    """A ``ds_config`` path names an existing regular file: checked by ``stat`` alone when the plan
    is built or loaded (a plan is data: the file is read only when the plan is applied, and a FIFO
    would block the reader)."""
    if isinstance(value, str | os.PathLike):
        untrusted.require_regular_file(value, _FIELD)
    elif value is not None and not isinstance(value, dict):
        raise ConfigError(_FIELD, type(value).__name__, "None, a dict or a JSON file path")


def read_ds_config(value) -> dict:
    """The user's DeepSpeed config as a dict (a regular JSON file of at most 16 MiB read); typed error if not."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return _thawed(value)
    if isinstance(value, str | os.PathLike):
        raw = untrusted.read_regular_file(value, _FIELD)
        try:
            data = untrusted.loads(raw.decode("utf-8"), _FIELD)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(_FIELD, str(value), f"a readable DeepSpeed JSON file ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError("DeepSpeed3DParallelConfig.ds_config", str(value), "a JSON object")
        return data
    raise ConfigError("DeepSpeed3DParallelConfig.ds_config", type(value).__name__, "None, a dict or a JSON file path")


# ---------------------------------------------------------------------------------------------
# the DeepSpeed config, topology, optimizer and the loop
# ---------------------------------------------------------------------------------------------


def _contradiction(key: str, value, plan_value, why: str):
    return ConfigError(f"ds_config[{key!r}]", value, f"{plan_value!r} ({why}), or leave it out")


def engine_config(
    user: dict, *, data_size: int, stages: int, per_rank_batch: int | None, clip: float | None, half: str | None
) -> dict:
    """The engine's config: the plan's facts, then the user's keys.

    ConfigError naming a key that contradicts the plan.
    """
    config = dict(user)
    m, g = user.get("train_micro_batch_size_per_gpu"), user.get("gradient_accumulation_steps")
    for key, v in (("train_micro_batch_size_per_gpu", m), ("gradient_accumulation_steps", g)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"ds_config[{key!r}]", v, "an integer >= 1")
    if per_rank_batch:
        if m is not None and g is not None and m * g != per_rank_batch:
            raise _contradiction(
                "gradient_accumulation_steps",
                g,
                per_rank_batch // m if per_rank_batch % m == 0 else None,
                f"micro-batch {m} x steps must be the loader's per-rank batch {per_rank_batch}",
            )
        if g is None:
            g = (per_rank_batch // m) if m else (stages if per_rank_batch % stages == 0 else 1)
        if m is None:
            m = per_rank_batch // g
        if m * g != per_rank_batch:
            raise _contradiction(
                "train_micro_batch_size_per_gpu",
                m,
                per_rank_batch // g if per_rank_batch % g == 0 else None,
                f"micro-batch x {g} steps must be the loader's per-rank batch {per_rank_batch}",
            )
    else:
        g = g or stages
        m = m or 1
    total = m * g * data_size
    if "train_batch_size" in user and user["train_batch_size"] != total:
        raise _contradiction(
            "train_batch_size", user["train_batch_size"], total, f"micro-batch {m} x {g} steps x data size {data_size}"
        )
    config.update(train_micro_batch_size_per_gpu=m, gradient_accumulation_steps=g, train_batch_size=total)
    if clip is not None:
        if user.get("gradient_clipping") not in (None, clip):
            raise _contradiction("gradient_clipping", user["gradient_clipping"], clip, "clip_grad in the plan")
        config["gradient_clipping"] = float(clip)
    else:  # DeepSpeed's own default clips at 1.0: a plan without clip_grad does not clip unless ds_config says so
        config.setdefault("gradient_clipping", 0.0)
    for name in ("bf16", "fp16"):
        if half is not None and name in user and bool((user[name] or {}).get("enabled", False)) != (name == half):
            raise _contradiction(name, user[name], {"enabled": name == half}, f"half({half!r}) in the plan")
    if half is not None:
        config[half] = {**(user.get(half) or {}), "enabled": True}
    zero = dict(user.get("zero_optimization") or {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1):
        raise ConfigError(
            "ds_config['zero_optimization']['stage']",
            stage,
            "0 or 1 (DeepSpeed's pipeline engine supports no higher ZeRO stage)",
        )
    config["zero_optimization"] = {**zero, "stage": stage}
    # activations cross stages whole: DeepSpeed would otherwise split them over the tensor ranks for the send
    config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False, **(user.get("pipeline") or {})}
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 2**31 - 1)
    config.setdefault("wall_clock_breakdown", False)
    return config


def topology(layout):
    """DeepSpeed's ProcessTopology over the layout's mesh order (pipe / data / model), so its groups are the mesh's."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    names = {"pipeline": "pipe", "data": "data", "tensor": "model"}
    axes, dims = [], []
    for n, s in zip(layout.mesh_dim_names, layout.mesh_shape, strict=True):
        axes.append(names[n])
        dims.append(s)
    for n in ("pipe", "data", "model"):
        if n not in axes:
            axes.insert(0, n)
            dims.insert(0, 1)
    return ProcessTopology(axes=axes, dims=dims)


def original_name(stage_name: str, entries, tie_first: bool) -> str:
    """The user's parameter name of a stage parameter.

    ``"3.mlp.up_proj.weight"`` -> ``"model.layers.2.mlp.up_proj.weight"``.
    """
    head, _, rest = stage_name.partition(".")
    if head == "tied_modules":
        _, _, rest = rest.partition(".")
        return f"{entries[0][0]}.{rest}"
    return f"{entries[int(head)][0]}.{rest}"  # spec i is entries[i] (with tie_first the logit spec comes after them)


def stage_optimizer(optim, names: dict[int, str], pipe, entries, tie_first: bool):
    """The user's optimizer class over this stage's parameters, each in the param group its original held."""
    import inspect

    group_of = {names[id(p)]: i for i, g in enumerate(optim.param_groups) for p in g["params"] if id(p) in names}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optim.param_groups]
    for n, p in pipe.named_parameters():
        i = group_of.get(original_name(n, entries, tie_first))
        if i is not None:
            groups[i]["params"].append(p)
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError(
            "optim",
            type(optim).__name__,
            "an optimizer over the model's parameters (none of this stage's parameters is in it)",
        )
    accepted = inspect.signature(type(optim).__init__).parameters
    new = type(optim)(groups, **{k: v for k, v in optim.defaults.items() if k in accepted})
    new.defaults = dict(optim.defaults)
    return new


def exact_clipping(engine, tp_rank: int) -> None:
    """Clip by the global gradient norm of the one model the ranks hold together (the fp32 ZeRO-0 path).

    DeepSpeed's fp32 clipping (``runtime.utils.clip_grad_norm_``) counts parameters that are not
    tensor-parallel only on rank 0 of its model-parallel group, which spans the pipeline stages too:
    the other stages' norms and biases are left out, so a pipeline clips by a smaller norm than one
    process would (measured here: losses 6e-5 off after one clipped SGD step at pp2). This counts
    each parameter once: tensor-parallel shards on every tensor rank, replicated ones on tensor rank 0,
    a tied copy only where DeepSpeed owns it (not ``ds_pipe_replicated``); the squares are summed over
    the stages and tensor ranks (data ranks hold equal, averaged gradients). The other paths (bf16,
    fp16, ZeRO-1) clip inside DeepSpeed's optimizers, unchanged (ZeRO-1 measured exact at tp2 x dp2 and pp2 x dp2).
    """
    import torch
    import torch.distributed as dist

    def clip_fp32_gradients():
        params = [p for p in engine.module.parameters() if p.grad is not None]
        mine = [
            p.grad
            for p in params
            if not getattr(p, "ds_pipe_replicated", False)
            and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))
        ]
        square = torch.stack([g.detach().float().pow(2).sum() for g in mine]).sum() if mine else torch.zeros(())
        dist.all_reduce(square, group=engine.grid.get_model_parallel_group())
        coef = (engine.gradient_clipping() / (square.sqrt() + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))

    engine.clip_fp32_gradients = clip_fp32_gradients


class Ds3dRunner:
    """What :func:`composable_atorch.train_step` drives: the batch cut into micro-batches for ``train_batch``."""

    def __init__(self, engine, micro: int, steps: int):
        self.engine, self.micro, self.steps = engine, micro, steps

    def step(self, inputs, targets, loss_fn) -> float:
        rows = inputs.size(0)
        if rows != self.micro * self.steps:
            raise ConfigError(
                "ds_3d_parallel batch", rows, f"micro-batch {self.micro} x {self.steps} micro-batches per train_batch"
            )
        if loss_fn is not None:
            self.engine.module.loss_fn = loss_fn
        pieces = zip(inputs.split(self.micro), targets.split(self.micro), strict=True)
        return float(self.engine.train_batch(iter(list(pieces))))


class Ds3dHook(OptimizerHook):
    """``train_batch`` ran backward and the step: the plan optimizer's step and zero_grad do nothing more."""

    def __init__(self, clips: bool):
        self.clips_gradients = clips

    def backward(self, loss, **kwargs):
        raise ConfigError(
            "optim.backward(loss)",
            "a DeepSpeed pipeline",
            "engine.train_batch(data_iter) or composable_atorch.train_step(...)",
        )

    def run_step(self, optimizer, closure=None):
        return True

    def zero_grad(self, optimizer, set_to_none):
        return True


def _engine_dtype(config: dict) -> str:
    """The dtype DeepSpeed's engine trains in, read back from its config (for the plan's note)."""
    for half in ("bf16", "fp16"):
        if config.get(half, {}).get("enabled"):
            return half
    return "fp32"


def engine_notes(pc, sizes: dict, checked, specs, pipe, builder, config: dict) -> list[str]:
    """ds_3d_parallel's lines for explain(): this rank's stage and layers, how they were built (``checked``: what
    the transform read from the model; ``builder``: the StageBuilder) and sharded, the engine's config."""
    stage = pc.layout.coordinate(pc.rank, "pipeline")
    lo, hi = pipe.parts[stage], pipe.parts[stage + 1]
    lines = [
        f"DeepSpeed pipeline {sizes['pipeline']} x tensor {sizes['tensor']} x data {sizes['data']}; this rank is "
        f"stage {stage}: layers {lo}..{hi - 1} of {len(specs)} ({', '.join(repr(s) for s in specs[lo:hi])})",
        f"{checked.patch_note}; {checked.n_blocks} {checked.block} blocks balanced over the stages; layers built "
        "from recorded init args, seeded base_seed + layer index",
    ]
    if checked.dropped_head:
        lines.append(
            f"{checked.dropped_head} is tied to {checked.entries[0][0]}: computed by the tied embedding's logit "
            "helper on the last stage"
        )
    if builder.rewrite is not None:
        done = sorted(set(builder.rewrite_notes)) or ["no layer built on this rank"]
        lines.append(f"module_replace on each layer as it is built: {'; '.join(done)}")
    if checked.shard:
        lines.append(
            f"Megatron-style tensor sharding of {len(checked.shard)} layers over the tensor dim of {sizes['tensor']} "
            f"({len(checked.shrink)} shrunk, {len(checked.drops)} dropouts in seeded streams)"
        )
    lines.append(
        f"engine config: micro-batch {config['train_micro_batch_size_per_gpu']}, "
        f"{config['gradient_accumulation_steps']} micro-batches per train_batch, "
        f"ZeRO-{config['zero_optimization']['stage']}, clipping {config.get('gradient_clipping', 0)}, "
        f"{_engine_dtype(config)}"
    )
    return lines

"""ds_3d_parallel at world 4 on gloo: DeepSpeed's pipeline engine against one plain-PyTorch process.

One spawned group runs every case (a group costs ~11 s at world 4, DeepSpeed's first initialize
~60 s cold). The reference is the same model (the weights every stage builds: base_seed + layer
index) trained in one process on the same global batches; the first steps' losses must match
within 1e-4 in fp32 (measured: 0 to 5e-7). SGD keeps the comparison sensitive: a wrong gradient
shows at the next step (DeepSpeed's default gradient_clipping of 1.0 showed as 7e-5 with AdamW
but 1e-3 with SGD before the plan set it).
"""

from __future__ import annotations

import functools

import pytest
import torch

import composable_atorch as ca
import equivalence as eq
from composable_atorch.errors import CompositionError
from zoo import configs

from _dist import module_world

pytestmark = [pytest.mark.dist, pytest.mark.slow]

VOCAB, SEQ, STEPS = 64, 16, 3


lm_loss = eq.token_ce


def llama_config(tied: bool):
    return configs.llama_config(layers=4, vocab=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied)


def llama_tpinfo():
    info = ca.TPInfo()
    info.shard_col("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    info.shard_row("self_attn.o_proj", "mlp.down_proj")
    info.shard_vocab("embed_tokens")
    return info


def batches(global_batch: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def reference_losses(meta, model, data, base_seed=1234, optim=torch.optim.SGD, lr=0.05, clip=None):
    """The plain model with the weights each stage builds, trained in one process."""
    from composable_atorch.transforms.parallel.ds3d.build import StageBuilder, check_model, module_list

    entries, _ = check_model(
        meta, module_list(meta), tie_first=bool(getattr(meta.config, "tie_word_embeddings", False))
    )
    builder = StageBuilder(root=meta, base_seed=base_seed)
    with torch.no_grad():
        for i, (name, m) in enumerate(entries):
            model.get_submodule(name).load_state_dict(builder.build(name, m, i).state_dict())
    clip_fn = (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), clip)) if clip else None
    return eq.reference(model, optim(model.parameters(), lr=lr), data, lm_loss, on_grads=clip_fn)[1]


def _slices(data, layout, rank, micro, steps):
    """This rank's micro-batches of each global batch: its data shard, cut into ``steps`` pieces."""
    d, n = layout.coordinate(rank, "data"), layout.size("data")
    out = []
    for x, y in data:
        rows = x.size(0) // n
        xs, ys = x[d * rows : (d + 1) * rows], y[d * rows : (d + 1) * rows]
        out.append(list(zip(xs.split(micro), ys.split(micro), strict=True)))
    return out


def _llama_case(rank, world, groups, tied, tpinfo, optim=torch.optim.SGD, lr=0.05, clip=None, zero=0):
    from transformers import LlamaForCausalLM

    cfg = llama_config(tied)
    with ca.record_module_init():
        meta = LlamaForCausalLM(cfg)
    ds_cfg = ca.DeepSpeed3DParallelConfig(
        tpinfo=tpinfo,
        tie_first=tied,
        ds_config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": zero},
        },
    )
    strategy = [("parallel_mode", (groups, None)), ("deepspeed_3d_parallel", ds_cfg)] + (
        [("clip_grad", {"max_norm": clip})] if clip else []
    )
    status, result, plan = ca.auto_accelerate(
        meta,
        optim,
        optim_args={"lr": lr},
        loss_func=lm_loss,
        load_strategy=strategy,
        ignore_dryrun_on_load_strategy=True,
    )
    engine = result.model
    layout = ca.runtime.layout.plan_layout(groups, world)
    data = batches(2 * 2 * layout.size("data"), STEPS)
    losses = [float(engine.train_batch(iter(mb))) for mb in _slices(data, layout, rank, 2, 2)]
    out = {
        "losses": losses,
        "engine": type(engine).__name__,
        "explain": plan.explain(),
        "n_params": sum(p.numel() for p in engine.module.parameters()),
    }
    if rank == 0:
        with torch.device("cpu"):
            ref_model = LlamaForCausalLM(cfg)
        out["reference"] = reference_losses(meta, ref_model, data, optim=optim, lr=lr, clip=clip)
    return out


def _gpt2_patcher(n_layer):
    """The seed's gpt2_custom_patcher, for transformers 5 (blocks return a tensor; the mask made causal)."""

    def wpe_patcher(fw, self):
        @functools.wraps(fw)
        def fw_wrapper(input):
            hidden_states, position_ids, attention_mask = input
            return hidden_states + fw(position_ids), attention_mask

        return fw_wrapper

    def h_patcher(fw, self):
        @functools.wraps(fw)
        def fw_wrapper(input):
            hidden_states, attention_mask = input
            t = hidden_states.size(1)
            causal = torch.ones(t, t, dtype=torch.bool, device=hidden_states.device).tril()
            keep = causal[None, None] & attention_mask[:, None, None, :].bool()
            mask = torch.zeros(keep.shape, dtype=hidden_states.dtype).masked_fill(
                ~keep, torch.finfo(hidden_states.dtype).min
            )
            out = fw(hidden_states, attention_mask=mask)
            return (out[0] if isinstance(out, tuple) else out), attention_mask

        return fw_wrapper

    patchers = {"transformer.wpe": wpe_patcher}
    patchers.update({f"transformer.h.{i}": h_patcher for i in range(n_layer)})
    return patchers


def gpt2_batch_fn(batch):
    ids, labels = batch
    positions = torch.arange(ids.size(1)).unsqueeze(0).expand_as(ids)
    return (ids, positions, torch.ones_like(ids)), labels


def _gpt2_case(rank, world):
    from transformers import GPT2LMHeadModel

    cfg = configs.gpt2_config(layers=4, vocab=VOCAB, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    with ca.record_module_init():
        meta = GPT2LMHeadModel(cfg)
    info = ca.TPInfo()
    info.shard_col({"attn.c_attn": {"stride": 3}}, "mlp.c_fc")
    info.shard_row("attn.c_proj", "mlp.c_proj")
    info.shard_vocab("wte")
    info.replic_drop("resid_dropout", "mlp.dropout", "drop")
    info.parallel_drop("attn_dropout")
    info.shrink({".attn": {"embed_dim", "split_size", "num_heads"}})
    ds_cfg = ca.DeepSpeed3DParallelConfig(
        tpinfo=info,
        custom_patcher=_gpt2_patcher(cfg.n_layer),
        batch_fn=gpt2_batch_fn,
        ds_config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    )
    groups = [("tensor", 2), ("data", 1), ("pipeline", 2)]
    _, result, _ = ca.auto_accelerate(
        meta,
        torch.optim.AdamW,
        optim_args={"lr": 3e-3},
        loss_func=lm_loss,
        load_strategy=[("parallel_mode", (groups, None)), ("ds_3d_parallel", ds_cfg)],
    )
    engine = result.model
    # a learnable sequence: each token is the previous one plus one
    start = torch.randint(0, VOCAB, (8, 1), generator=torch.Generator().manual_seed(1))
    ids = (start + torch.arange(SEQ + 1)) % VOCAB
    batch = (ids[:, :-1], ids[:, 1:])
    losses = [
        float(engine.train_batch(iter([(batch[0][:4], batch[1][:4]), (batch[0][4:], batch[1][4:])]))) for _ in range(12)
    ]
    return {"losses": losses}


def _bad_inputs(rank, world):
    """Typed errors before any work: each raised before DeepSpeed builds anything."""
    from transformers import LlamaForCausalLM

    out = {}
    with ca.record_module_init():
        meta = LlamaForCausalLM(llama_config(False))

    def attempt(key, groups, cfg):
        try:
            ca.auto_accelerate(
                meta,
                torch.optim.AdamW,
                loss_func=lm_loss,
                load_strategy=[("parallel_mode", (groups, None)), ("ds_3d_parallel", cfg)],
            )
            out[key] = "no error"
        except CompositionError as exc:
            out[key] = type(exc).__name__ + ": " + str(exc)

    attempt("degrees", [("tensor", 3), ("pipeline", 2)], ca.DeepSpeed3DParallelConfig(tie_first=False))
    attempt(
        "tpinfo",
        [("tensor", 2), ("pipeline", 2)],
        ca.DeepSpeed3DParallelConfig(tie_first=False, tpinfo=ca.TPInfo().shard_col("no_such_proj")),
    )
    attempt(
        "patcher",
        [("data", 2), ("pipeline", 2)],
        ca.DeepSpeed3DParallelConfig(tie_first=False, custom_patcher={"model.no_such": lambda fw, m: fw}),
    )
    attempt("untied", [("data", 2), ("pipeline", 2)], ca.DeepSpeed3DParallelConfig())
    attempt(
        "ds_config",
        [("data", 2), ("pipeline", 2)],
        ca.DeepSpeed3DParallelConfig(tie_first=False, ds_config={"zero_optimization": {"stage": 2}}),
    )
    return out


def run_cases(rank, world):
    results = {"bad": _bad_inputs(rank, world)}
    results["pp2_dp2"] = _llama_case(rank, world, [("data", 2), ("pipeline", 2)], tied=False, tpinfo=None)
    results["tp2_pp2"] = _llama_case(
        rank, world, [("tensor", 2), ("data", 1), ("pipeline", 2)], tied=True, tpinfo=llama_tpinfo()
    )
    results["tp2_pp2_adamw"] = _llama_case(
        rank,
        world,
        [("tensor", 2), ("data", 1), ("pipeline", 2)],
        tied=True,
        tpinfo=llama_tpinfo(),
        optim=torch.optim.AdamW,
        lr=1e-3,
    )
    # clipping by the norm of the whole model (DeepSpeed's own fp32 clipping leaves other stages' norms out)
    results["tp2_pp2_clip"] = _llama_case(
        rank, world, [("tensor", 2), ("data", 1), ("pipeline", 2)], tied=True, tpinfo=llama_tpinfo(), clip=0.3
    )
    results["tp2_dp2_zero1"] = _llama_case(
        rank, world, [("tensor", 2), ("data", 2)], tied=True, tpinfo=llama_tpinfo(), zero=1
    )
    results["tp2_dp2_zero1_clip"] = _llama_case(
        rank, world, [("tensor", 2), ("data", 2)], tied=True, tpinfo=llama_tpinfo(), zero=1, clip=0.3
    )
    results["pp2_dp2_zero1_clip"] = _llama_case(
        rank, world, [("data", 2), ("pipeline", 2)], tied=True, tpinfo=None, zero=1, clip=0.3
    )
    results["pp2_dp2_clip"] = _llama_case(
        rank, world, [("data", 2), ("pipeline", 2)], tied=False, tpinfo=None, clip=0.3
    )
    results["gpt2"] = _gpt2_case(rank, world)
    return results


world4 = module_world(run_cases, 4, timeout=900)


@pytest.mark.parametrize(
    "case",
    [
        "pp2_dp2",
        "tp2_pp2",
        "tp2_pp2_adamw",
        "tp2_pp2_clip",
        "pp2_dp2_clip",
        "tp2_dp2_zero1",
        "tp2_dp2_zero1_clip",
        "pp2_dp2_zero1_clip",
    ],
)
def test_losses_match_one_process(world4, case):
    results = [r[case] for r in world4]
    ref = results[0]["reference"]
    assert all(r["engine"] == "PipelineEngine" for r in results)
    print(
        case,
        "reference",
        ref,
        "max |diff| per rank",
        [max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True)) for r in results],
    )
    for rank, r in enumerate(results):  # train_batch returns the global mean loss on every rank
        assert max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True)) < 1e-4, (case, rank, r["losses"], ref)


def test_tensor_parallel_stages_hold_a_quarter_of_the_blocks(world4):
    pp_dp = [r["pp2_dp2"]["n_params"] for r in world4]
    tp_pp = [r["tp2_pp2"]["n_params"] for r in world4]
    assert all(t < p for t, p in zip(tp_pp, pp_dp, strict=True)), (tp_pp, pp_dp)


def test_gpt2_with_seed_patchers_and_tpinfo_trains(world4):
    losses = world4[0]["gpt2"]["losses"]
    print("gpt2 tp2 x pp2 losses", losses)
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(r["gpt2"]["losses"] == losses for r in world4)


def test_bad_input_is_a_typed_error_before_any_work(world4):
    bad = world4[0]["bad"]
    assert bad["degrees"].startswith("ConfigError") and "parallel_mode.groups" in bad["degrees"], bad["degrees"]
    assert bad["tpinfo"].startswith("TensorParallelPlanError") and "no_such_proj" in bad["tpinfo"], bad["tpinfo"]
    assert bad["patcher"].startswith("ConfigError") and "model.no_such" in bad["patcher"], bad["patcher"]
    assert bad["untied"].startswith("ConfigError") and "tie_first" in bad["untied"], bad["untied"]
    assert bad["ds_config"].startswith("ConfigError") and "zero_optimization" in bad["ds_config"], bad["ds_config"]


@pytest.mark.parametrize("model_parallel", ["2"])
def test_example_ds_3d_llama2_through_the_launcher(model_parallel):
    """Seed 002's DS 3D example at world 4 (tp2 x pp2) through the launcher: it prints the loss falling.
    (Its pp2 x dp2 layout is test_losses_match_one_process[pp2_dp2]'s, equal to one process there.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "ds_3d_llama2.py"
    env = {**os.environ, "PIPELINE_PARALLEL_SIZE": "2", "MODEL_PARALLEL_SIZE": model_parallel, "DS_ACCELERATOR": "cpu"}
    env.pop("OMP_NUM_THREADS", None)  # the launcher sets 1 per rank
    cmd = [sys.executable, "-m", "composable_atorch", "launch", "--nproc", "4", str(script), "--max_steps", "8"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"tensor {model_parallel}, data {4 // (2 * int(model_parallel))}, pipeline 2" in proc.stdout
    assert "(falling)" in proc.stdout, proc.stdout[-2000:]
    # ATorch's script asks for module_replace too: each stage's layers get it as they are built
    assert "module_replace on each layer as it is built" in proc.stdout or "module_replace(" in proc.stdout

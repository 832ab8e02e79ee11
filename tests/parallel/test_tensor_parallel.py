"""tensor_parallel at world 2 against one process; planner errors before any work."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import composable_atorch as ca
import equivalence as eq
from composable_atorch.core.transform import lookup
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.tensor import TensorParallelPlanError, TPInfo, auto_plan, full_weight
from zoo.configs import gpt2_config, llama_config

from _dist import run_world

STEPS, LR = 4, 0.1
# SGD, not Adam: Adam divides by sqrt(v), so a gradient that is zero up to rounding (the key bias:
# softmax ignores a constant shift) turns reduction-order noise of 1e-9 into 1e-3 weight gaps.


def gpt():
    from composable_atorch.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4))


def llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(max_position_embeddings=32))


def gpt2(drop=0.0, attn_drop=0.0, **extra):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    drops = {"resid_pdrop": drop, "embd_pdrop": drop, "attn_pdrop": attn_drop}
    return GPT2LMHeadModel(gpt2_config(n_positions=32, **drops, **extra))


def gpt2_dropout():
    """Replicated dropouts only (resid / mlp / embedding p=0.1): TP must draw one process's masks."""
    return gpt2(drop=0.1)


def gpt2_tpinfo(vocab: bool = False) -> TPInfo:
    info = TPInfo()
    info.shard_col({"attn.c_attn": {"stride": 3}}, "mlp.c_fc")
    info.shard_row("attn.c_proj", "mlp.c_proj")
    if vocab:
        info.shard_vocab("wte")
    info.replic_drop("resid_dropout", "mlp.dropout", "drop")
    info.parallel_drop("attn_dropout")
    info.shrink({".attn": {"embed_dim", "split_size", "num_heads"}})
    return info


def _batches(vocab):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, vocab, (4, 16), generator=g))
        for _ in range(STEPS)
    ]


def _train(model, optim, batches):
    losses = []
    for x, y in batches:
        loss = eq.token_ce(model(x), y)
        optim.backward(loss) if hasattr(optim, "backward") else loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model):
    out = {}
    mods = dict(model.named_modules())
    for name, _ in model.named_parameters():
        mod, _, attr = name.rpartition(".")
        out[name] = full_weight(mods[mod], attr)
    return out


def _case(make, plan_arg, vocab, sp=False, transform=None):
    ref = make()
    model = copy.deepcopy(ref)
    batches = _batches(vocab)
    torch.manual_seed(5)
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=LR), batches)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    # ranks seeded differently: tensor_parallel synchronizes the stream replicated dropouts draw
    torch.manual_seed(5 if torch.distributed.get_rank() == 0 else 6)
    plan = ca.compose(
        transform or ca.tensor_parallel(plan_arg, sequence_parallel=sp), ca.parallel_mode([("tensor", 2)])
    )
    model, optim, _ = plan(model, optim)
    sharded = {}
    for name, p in model.named_parameters():
        if hasattr(p, "to_local") and any(pl.is_shard() for pl in p.placements):
            sharded[name] = p.to_local().numel() / p.numel()
    # SequenceParallel makes the blocks' norm weights replicated DTensors
    sp_norms = sum(
        1 for n, p in model.named_parameters() if "norm" in n or ".ln" in n or "ln_" in n if hasattr(p, "placements")
    )
    losses = [ca.train_step(model, optim, x, y, eq.token_ce) for x, y in batches]
    full = _full(model)
    ref_p = dict(ref.named_parameters())
    weight_gap = max((full[n] - ref_p[n].detach()).abs().max().item() for n in ref_p if n in full)
    return {
        "loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "weight_gap": weight_gap,
        "sharded": sharded,
        "names_kept": sorted(full) == sorted(n for n, _ in ref.named_parameters()),
        "sp": sp,
        "sp_norms": sp_norms,
    }


def _tp_plan_applied():
    model = gpt()
    plan = ca.compose(ca.tensor_parallel(), ca.parallel_mode([("tensor", 2)]))
    return plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _save_resume(directory):
    """DTensor weights and Adam state through DCP: resuming gives the same next losses."""
    batches = _batches(256)
    model, optim, _ = _tp_plan_applied()
    _train(model, optim, batches[:2])
    ca.save_state(directory, model, optim, step=2)
    after = _train(model, optim, batches[2:])
    model2, optim2, _ = _tp_plan_applied()
    ca.load_state(directory, model2, optim2)
    resumed = _train(model2, optim2, batches[2:])
    return max(abs(a - b) for a, b in zip(after, resumed, strict=True))


def _dropout_streams():
    """One training forward: replic_drop masks equal across tensor ranks, parallel_drop masks differ."""
    import warnings

    model = gpt2(
        drop=0.5, attn_drop=0.5, reorder_and_upcast_attn=True, attn_implementation="eager"
    )  # calls attn_dropout
    model, _, _ = ca.compose(ca.tensor_parallel(gpt2_tpinfo()), ca.parallel_mode([("tensor", 2)]))(model)
    seen = {}
    attn = model.transformer.h[0].attn

    def keep(name):
        def hook(_module, _args, out):
            seen.setdefault(
                name, (out == 0).numpy().copy()
            )  # numpy: tensors would cross the process boundary by shared memory

        return hook

    for name in ("attn_dropout", "resid_dropout"):
        getattr(attn, name).register_forward_hook(keep(name))
    x = _batches(128)[0][0]
    model(x)
    # HF's default attention drops inside its kernel and never calls attn_dropout: warned, not silent
    sdpa, _, _ = ca.compose(ca.tensor_parallel(gpt2_tpinfo()), ca.parallel_mode([("tensor", 2)]))(gpt2(attn_drop=0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sdpa(x)
    return {**seen, "warned": any("parallel_drop" in str(w.message) for w in caught)}


def _strided_checkpoint(directory):
    """GPT-2's fused qkv (stride 3) saved at TP2: the checkpoint holds the unpermuted weights and Adam state."""
    model = gpt2()
    plan = ca.compose(ca.tensor_parallel(gpt2_tpinfo()), ca.parallel_mode([("tensor", 2)]))
    model, optim, _ = plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train(model, optim, _batches(128)[:2])
    ca.save_state(directory, model, optim, step=2)
    full = _full(model)
    mods = dict(model.named_modules())
    state = {}
    for name, p in model.named_parameters():
        mod, _, attr = name.rpartition(".")
        state[name] = full_weight(mods[mod], attr, optim.state[p]["exp_avg"])
    # TP2 -> TP2: the same plan loads it back exactly (through the unpermuted layout)
    model2 = gpt2()
    model2, optim2, _ = plan(model2, torch.optim.AdamW(model2.parameters(), lr=1e-3))
    ca.load_state(directory, model2, optim2, verbose=False)
    back = _full(model2)
    ok = all(torch.equal(back[n], full[n]) for n in full)
    return {
        "full": {n: t.detach().numpy() for n, t in full.items()},
        "exp_avg": {n: t.detach().numpy() for n, t in state.items()},
        "tp_roundtrip": ok,
    }


def _world(rank, world, directory):
    return {
        "dropout": _dropout_streams(),
        "strided": _strided_checkpoint(directory + "-strided"),
        "resume_gap": _save_resume(directory),
        "gpt": _case(gpt, "auto", 256),
        "gpt_sp": _case(gpt, "auto", 256, sp=True),
        "llama": _case(llama, "auto", 128),
        "llama_sp": _case(llama, "auto", 128, sp=True),
        "gpt2": _case(gpt2, gpt2_tpinfo(), 128),
        "gpt2_vocab": _case(gpt2, gpt2_tpinfo(vocab=True), 128),
        "gpt2_sp": _case(gpt2, gpt2_tpinfo(), 128, sp=True),
        "gpt2_replic_dropout": _case(gpt2_dropout, gpt2_tpinfo(), 128),
        # Megatron-style sequence parallelism from a seed (ATorch's name sequence_parallel is Ulysses, see
        # test_ulysses.py); dropouts in the blocks see a sequence shard
        "gpt2_replic_dropout_seq_seed_name": _case(
            gpt2_dropout,
            None,
            128,
            sp=True,
            transform=lookup("tensor_parallel").from_seed({"plan": gpt2_tpinfo(), "sequence_parallel": True}),
        ),
        "llama_seq_seed_name": _case(
            llama, None, 128, sp=True, transform=lookup("tensor_parallel").from_seed({"sequence_parallel": True})
        ),
    }


@pytest.mark.dist
def test_tensor_parallel_matches_one_process(tmp_path):
    results = run_world(_world, 2, str(tmp_path / "ckpt"), timeout=600)
    drops = [r.pop("dropout") for r in results]
    assert (drops[0]["resid_dropout"] == drops[1]["resid_dropout"]).all(), (
        "replic_drop: one stream on every tensor rank"
    )
    assert drops[0]["resid_dropout"].any()
    assert (drops[0]["attn_dropout"] != drops[1]["attn_dropout"]).any(), "parallel_drop: a stream per rank"
    assert drops[0]["warned"] and drops[1]["warned"]
    _check_strided_checkpoint([r.pop("strided") for r in results], str(tmp_path / "ckpt-strided"))
    for rank, res in enumerate(results):
        assert res.pop("resume_gap") == 0.0, rank
        for name, r in res.items():
            assert r["loss_gap"] < 1e-5, (rank, name, r["loss_gap"])
            assert r["weight_gap"] < 1e-5, (rank, name, r["weight_gap"])
            assert r["names_kept"], name
            assert (r["sp_norms"] > 0) == r["sp"], (name, r["sp_norms"])
            assert r["sharded"], f"{name}: nothing sharded"
            assert all(abs(f - 0.5) < 1e-9 for f in r["sharded"].values()), (name, r["sharded"])
    print({n: (r["loss_gap"], r["weight_gap"], len(r["sharded"])) for n, r in results[0].items()})


def _check_strided_checkpoint(ranks, directory):
    """TP2 -> one process: the fused qkv and its Adam state come back unpermuted, exactly."""
    assert all(r["tp_roundtrip"] for r in ranks)
    model = gpt2()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ca.load_state(directory, model, optim, verbose=False)
    saved = ranks[0]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.from_numpy(saved["full"][name])), name
        assert torch.equal(optim.state[p]["exp_avg"], torch.from_numpy(saved["exp_avg"][name])), name
    assert not torch.equal(
        torch.from_numpy(saved["full"]["transformer.h.0.attn.c_attn.weight"]),
        gpt2().transformer.h[0].attn.c_attn.weight.detach(),
    )


# -- planning and bad input (single process) ------------------------------------------------------


def test_auto_plan_gpt_and_llama():
    plan = auto_plan(gpt())
    assert ("col", "blocks.0.attn.q", ()) in plan and ("row", "blocks.1.mlp.fc2", ()) in plan
    assert ("shrink", "blocks.0.attn", ("n_head",)) in plan
    lplan = auto_plan(llama())
    assert ("col", "layers.*.self_attn.q_proj", ()) in lplan  # transformers' own base_model_tp_plan


def test_plain_linear_chain_pairs_col_then_row():
    """ATorch's plan-free toy model: consecutive Linears pair column -> row, whatever their names."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.Linear(6, 8), nn.Linear(8, 4))
    assert auto_plan(model) == (("col", "0", ()), ("col", "3", ()), ("row", "2", ()), ("row", "4", ()))


def test_unplaceable_model_names_layers_and_manual_form():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with pytest.raises(TensorParallelPlanError) as err:
        auto_plan(model)
    assert "0" in str(err.value) and "TPInfo()" in str(err.value)


def test_heads_not_divisible_keep_attention_whole():
    """Auto: attention whose heads do not divide stays replicated (said in explain), the MLP shards;
    a manual plan asking for it is a typed error."""
    from composable_atorch.models import GPT, GPTConfig

    m = GPT(GPTConfig(seq_len=8, d_model=24, n_layer=1, n_head=3))
    shard, shrink, _ = ca.tensor_parallel().placements(m, 2)
    assert sorted(shard) == ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2"] and not shrink
    assert any("heads not divisible" in n for n in ca.tensor_parallel().check(m, 2))
    with pytest.raises(TensorParallelPlanError, match="heads not divisible"):
        ca.tensor_parallel(auto_plan(GPT(GPTConfig(seq_len=8, d_model=24, n_layer=1, n_head=4)))).placements(m, 2)


class WideNormBlock(nn.Module):
    """``up -> LayerNorm over its whole output -> down`` (a norm over the whole q projection, as OLMo-2/3's
    q_norm): a rank's shard of ``up`` meets a norm of the full width. Then, with ``mlp``, a plain MLP."""

    def __init__(self, d: int = 16, mlp: bool = True):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.Linear(2 * d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) if mlp else None

    def forward(self, x):
        x = x + self.down(self.norm(self.up(x)))
        return x if self.mlp is None else x + self.mlp(x)


class WideNormNet(nn.Module):
    def __init__(self, mlp: bool = True):
        super().__init__()
        self.tok = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(WideNormBlock(mlp=mlp) for _ in range(2))
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_pair_failing_at_one_ranks_shapes_is_kept_whole_and_named():
    """Auto: the pair whose shard meets a full-width norm stays whole (named with the failure), the MLP
    shards; with no other pair the model is refused for that failure; a manual plan naming it is refused."""
    shard, _, _ = ca.tensor_parallel().placements(WideNormNet(), 2)
    assert sorted(shard) == [f"blocks.{i}.mlp.{j}" for i in (0, 1) for j in (0, 2)]
    notes = ca.tensor_parallel().check(WideNormNet(), 2)
    assert any("failing the check at one rank's shapes: blocks.*.{up -> down}: at tensor degree 2" in n for n in notes)
    with pytest.raises(TensorParallelPlanError, match="one rank's shapes fail a forward"):
        ca.tensor_parallel().check(WideNormNet(mlp=False), 2)
    with pytest.raises(TensorParallelPlanError, match="one rank's shapes fail a forward"):
        ca.tensor_parallel({"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}).check(WideNormNet(), 2)


def test_degree_not_dividing_world_fails_at_compose():
    env = ca.Environment(world_size=4)
    with pytest.raises(ConfigError):
        ca.compose(ca.tensor_parallel(), ca.parallel_mode([("tensor", 3), ("data", 1)]), env=env)


def test_parallel_mode_without_tensor_dim_conflicts():
    env = ca.Environment(world_size=2)
    with pytest.raises(ca.errors.ConflictError, match="tensor"):
        ca.compose(ca.tensor_parallel(), ca.parallel_mode([("data", 2)]), env=env)


def test_manual_plan_is_data():
    t = ca.tensor_parallel(gpt2_tpinfo())
    plan = ca.compose(t, env=ca.Environment(world_size=2))
    assert ca.Plan.from_json(plan.to_json(), env=plan.env) == plan
    assert ca.tensor_parallel({"blocks.*.attn.q": "colwise"}).plan == (("col", "blocks.*.attn.q", ()),)
    with pytest.raises(ConfigError):
        ca.tensor_parallel({"x": "diagonal"})

"""checkpoint(Block, policy="selective"): gradients equal to no checkpointing, the expensive ops
really not rerun, composed with compile, fsdp and tensor parallel.

Each reference is the same model trained with no checkpointing at all. Which ops a block keeps is
watched through the policy (``save_expensive_ops``); that they are not rerun is counted with a
dispatch mode over forward + backward: selective runs each matmul as often as no checkpointing does,
full checkpointing runs the forward's matmuls twice. (Memory: tests/estimate/test_estimate.py
measures selective between full and none, and the estimate's prediction of it.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import composable_atorch as ca
import zoo
from composable_atorch.errors import ConfigError
from composable_atorch.models import Block
from composable_atorch.models.gpt import lm_loss
from composable_atorch.transforms.memory import recompute

from helpers import gpt

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def saved(monkeypatch):
    """The ops the policy was asked about during the test, with its answer."""
    seen = set()
    policy = recompute.save_expensive_ops

    def spy(ctx, func, *args, **kwargs):
        answer = policy(ctx, func, *args, **kwargs)
        seen.add((str(func), answer.name))
        return answer

    monkeypatch.setattr(recompute, "save_expensive_ops", spy)
    return seen


def _blocks(model) -> tuple[type, ...]:
    return tuple({type(m) for m in model.modules() if type(m).__name__ in ("Block", "LlamaDecoderLayer", "UserBlock")})


def _grads(name, model, count=False):
    """Gradients of one training step on the zoo's batch (the built-in GPT on its own)."""
    model.train()
    counter = CountOps()
    with counter if count else torch.enable_grad():
        if name == "gpt":
            x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
            lm_loss(model(x), x).backward()
        else:
            zoo.zoo_loss(name, model, zoo.batch(name, seed=0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, counter.calls


def _build(name):
    return gpt() if name == "gpt" else zoo.build(name)


@pytest.mark.parametrize("name", ["gpt", "llama", "user"])
def test_gradients_bitwise_equal_to_no_checkpointing_and_matmuls_not_rerun(name, saved):
    ref, ref_calls = _grads(name, _build(name), count=True)
    model = _build(name)
    names = [n for n, _ in model.named_parameters()]
    plan = ca.compose(ca.checkpoint(*_blocks(model), policy="selective"))
    applied = plan(model)
    assert [n for n, _ in applied[0].named_parameters()] == names
    got, calls = _grads(name, applied[0], count=True)
    assert ref.keys() == got.keys() and len(ref) == len(names)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    kept = {op for op, answer in saved if answer == "MUST_SAVE"}
    attention = {
        "gpt": "aten.bmm.default",  # written out: matmul, mask, softmax
        "llama": "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "user": "aten._scaled_dot_product_flash_attention_for_cpu.default",
    }[name]
    assert attention in kept and kept & {"aten.mm.default", "aten.addmm.default"}, kept
    assert {op for op, answer in saved if answer == "PREFER_RECOMPUTE"}  # norms, activations: rerun
    for op in MATMULS | {attention}:
        assert calls[op] == ref_calls[op], (op, calls[op], ref_calls[op])  # saved, never rerun
    full_model = _build(name)
    ca.checkpoint(*_blocks(full_model))(full_model)
    _, full_calls = _grads(name, full_model, count=True)
    assert sum(full_calls[op] for op in MATMULS) > sum(calls[op] for op in MATMULS)  # full reruns them
    assert "selective: saves the outputs of matmuls" in plan.explain(applied=applied)


class InPlaceBlock(torch.nn.Module):
    """A user block in a common style: in-place ops on what its matmuls return, then a norm whose
    backward needs the mutated value (so the rerun goes through them)."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2, self.norm = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        h = self.fc1(x)
        h[:, : h.shape[1] // 2] *= 0.5  # a view of a saved output, written in place
        out = self.fc2(torch.relu(h))
        out += x
        return self.norm(out)


class InPlaceModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(InPlaceBlock() for _ in range(2))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _moe_grads(name, model, count=False):
    from zoo import moe

    model.train()
    counter = CountOps()
    with counter if count else torch.enable_grad():
        moe.loss(name, model, moe.batch(0)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counter.calls


@pytest.mark.parametrize("name", ["user_inplace", "mixtral", "hunyuan_v1_moe", "minimax"])
def test_saved_outputs_changed_in_place_are_replayed_as_made(name, saved):
    """Mixtral's, HunYuan-MoE's and MiniMax's routers divide their top-k weights in place; the user
    block writes to its matmuls' outputs. torch's cache held the mutated tensors and the backward
    stopped with "Tensor cached during selective activation checkpoint has been mutated"; now the
    gradients are bitwise those of no checkpointing and no matmul is rerun."""
    from zoo import moe

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))

    def build():
        if name == "user_inplace":
            torch.manual_seed(0)
            return InPlaceModel()
        return moe.build(name)

    def grads(model):
        if name == "user_inplace":
            counter = CountOps()
            with counter:
                model(x).square().mean().backward()
            return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.calls
        return _moe_grads(name, model, count=True)

    ref, ref_calls = grads(build())
    model = build()
    blocks = (InPlaceBlock,) if name == "user_inplace" else _decoder_layers(model)
    applied = ca.compose(ca.checkpoint(*blocks, policy="selective"))(model)
    got, calls = grads(applied[0])
    assert ref.keys() == got.keys() and ref
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    assert any(answer == "MUST_SAVE" for _, answer in saved)
    for op in MATMULS:
        assert calls[op] == ref_calls[op], (op, calls[op], ref_calls[op])


def _decoder_layers(model) -> tuple[type, ...]:
    return tuple({type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")})


def test_policy_is_validated_and_round_trips():
    with pytest.raises(ConfigError, match="'full' or 'selective'"):
        ca.checkpoint(Block, policy="ops")
    with pytest.raises(ConfigError, match="non-reentrant"):
        ca.checkpoint(Block, policy="selective", reentrant=True)
    with pytest.raises(ConfigError, match="non-reentrant"):
        ca.checkpoint({"wrap_class": Block, "no_reentrant": False}, policy="selective")
    selective = ca.checkpoint(Block, policy="selective")
    assert ca.checkpoint({"wrap_class": Block}, policy="selective") == selective
    assert ca.checkpoint(Block) == ca.checkpoint(Block, policy="full") != selective
    assert "selective" in selective.describe() and "selective" not in ca.checkpoint(Block).describe()
    assert selective.sort_key() != ca.checkpoint(Block).sort_key()
    plan = ca.compose(selective)
    back = ca.Plan.from_json(plan.to_json(), env=plan.env)
    assert back == plan and back.transforms[0].policy == "selective"


def test_selective_candidates_join_the_search():
    from composable_atorch.auto.space import SearchSpace, block_classes
    from composable_atorch.core.transform import SearchContext
    from composable_atorch.environment import Environment

    env = Environment.detect().with_(world_size=1)
    space = SearchSpace(SearchContext(env=env, block_classes=block_classes(gpt()), batch_size=8))
    labels = set(space.options["checkpoint"])
    assert {ca.checkpoint(Block).describe(), ca.checkpoint(Block, policy="selective").describe()} <= labels


def _train_compiled(plan, steps=3):
    torch.manual_seed(0)
    model = gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if plan is not None:
        model, optim, _ = plan(model, optim)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=gen)
        loss = lm_loss(model(x), x)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


def test_compiled_per_block_is_bitwise_equal(saved):
    ref_losses, ref = _train_compiled(None)
    plan = ca.compose(ca.checkpoint(Block, policy="selective"), ca.compile(backend="aot_eager"))
    assert plan.names == ("checkpoint", "compile")
    losses, got = _train_compiled(plan)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(got[n], w) for n, w in ref.items())
    assert ("aten.addmm.default", "MUST_SAVE") in saved


# -- world 2: fsdp and tensor parallel, one spawned group -------------------------------------------


def _fsdp_runs() -> dict:
    from equivalence import full_params

    from _dp import STEPS, loader, model, train

    out = {}
    for opt_name, make_opt in (
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    ):
        reference = model()
        ref_opt = make_opt(reference.parameters())
        train(reference, ref_opt, loader(), STEPS)
        out[f"{opt_name}/one process"] = full_params(reference)
        for label, transforms in (
            ("fsdp", (ca.fsdp(wrap=Block),)),
            ("fsdp+selective", (ca.fsdp(wrap=Block), ca.checkpoint(Block, policy="selective"))),
            # bf16: fsdp casts each block's inputs in a hook that the forward runs before the
            # checkpoint and the recompute inside it (under a record_function)
            ("fsdp+bf16", (ca.fsdp(wrap=Block), ca.amp("bf16"))),
            ("fsdp+bf16+selective", (ca.fsdp(wrap=Block), ca.amp("bf16"), ca.checkpoint(Block, policy="selective"))),
        ):
            m = model()
            m, opt, data = ca.compose(*transforms)(m, make_opt(m.parameters()), loader())
            train(m, opt, data, STEPS)
            out[f"{opt_name}/{label}"] = full_params(m)
    return out


def _tp_runs() -> dict:
    """The built-in GPT with SGD (Adam would magnify rounding in the key bias's zero gradient), tensor
    parallel with and without sequence parallelism, vs one process."""
    from composable_atorch.models import GPT, GPTConfig
    from composable_atorch.transforms.parallel.tensor import full_weight

    def make():
        torch.manual_seed(0)
        return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4))

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (4, 16), generator=gen),) * 2 for _ in range(4)]
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        lm_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out = {"reference": {n: p.detach().clone() for n, p in reference.named_parameters()}}
    for sp in (False, True):
        for label, extra in (
            ("tp", ()),
            ("tp+full", (ca.checkpoint(Block),)),
            ("tp+selective", (ca.checkpoint(Block, policy="selective"),)),
        ):
            model = make()
            plan = ca.compose(ca.tensor_parallel(sequence_parallel=sp), ca.parallel_mode([("tensor", 2)]), *extra)
            model, optim, _ = plan(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for x, y in batches:
                ca.train_step(model, optim, x, y, lm_loss)
            modules = dict(model.named_modules())
            out[f"sp={sp}/{label}"] = {
                n: full_weight(modules[n.rpartition(".")[0]], n.rpartition(".")[2]).detach().clone()
                for n, _ in model.named_parameters()
            }
    return out


def _world2(rank, world):
    from equivalence import plain

    return plain({"fsdp": _fsdp_runs(), "tp": _tp_runs()})


@pytest.mark.dist
def test_composed_with_fsdp_and_tensor_parallel_at_world_2():
    from equivalence import bitwise, max_diff

    from _dist import run_world

    for r in run_world(_world2, 2):
        fsdp = r["fsdp"]
        # measured vs one process: 6e-8 (SGD), 5e-5 (AdamW: the all-reduce's order, magnified by Adam)
        for opt, bound in (("sgd", 1e-6), ("adamw", 1e-4)):
            # FSDP2 reproduces itself bitwise; checkpointing must not change a bit of that
            assert bitwise(fsdp[f"{opt}/fsdp+selective"], fsdp[f"{opt}/fsdp"]), opt
            assert max_diff(fsdp[f"{opt}/fsdp+selective"], fsdp[f"{opt}/one process"]) < bound, opt
            assert bitwise(fsdp[f"{opt}/fsdp+bf16+selective"], fsdp[f"{opt}/fsdp+bf16"]), opt
        tp = r["tp"]
        for sp in (False, True):
            for policy in ("full", "selective"):  # full: the sequence split of the first block replayed once
                assert bitwise(tp[f"sp={sp}/tp+{policy}"], tp[f"sp={sp}/tp"]), (sp, policy)
            assert max_diff(tp[f"sp={sp}/tp+selective"], tp["reference"]) < 1e-5, sp

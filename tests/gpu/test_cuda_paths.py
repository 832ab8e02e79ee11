"""The CUDA twins of the CPU tests: the code paths users run on a GPU (issue 31).

Every test here needs a CUDA device and is skipped without one (marker ``cuda``); on a GPU machine
``benchmarks/gpu.py`` runs them first (``pytest -m cuda tests/gpu``). Each compares against plain
PyTorch on the same device, as the CPU tests do: they can fail.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import composable_atorch as ca
from composable_atorch.models.gpt import GPT, Block, GPTConfig, lm_loss

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu.py runs these)"),
]

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=2, n_head=4)
BATCH = 8


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).cuda()


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
        out.append((x[:, :-1].cuda(), x[:, 1:].cuda()))
    return out


def loader_of(data):
    """A loader yielding exactly ``data`` (the global batches), as the plans rebuild loaders."""
    xs = torch.cat([x.cpu() for x, _ in data])
    ys = torch.cat([y.cpu() for _, y in data])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH, shuffle=False)


def train(plan, data, optim_cls=torch.optim.AdamW, lr=1e-3):
    model = gpt()
    optim = optim_cls(model.parameters(), lr=lr)
    if plan is not None:
        model, optim, _ = ca.compose(plan)(model, optim, loader_of(data))
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        if hasattr(optim, "backward"):
            optim.backward(loss)
        else:
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_environment_detects_the_gpu():
    env = ca.Environment.detect()
    assert env.device == "cuda"
    assert env.compute_capability == torch.cuda.get_device_capability()


def test_amp_bf16_tracks_fp32_on_cuda():
    data = batches(6)
    _, ref = train(None, data)
    _, got = train(ca.amp("bf16"), data)
    assert all(abs(a - b) < 2e-2 * max(1.0, abs(a)) for a, b in zip(ref, got)), (ref, got)


def test_amp_fp16_scaler_skips_an_inf_step_then_trains():
    data = batches(3)
    model = gpt()
    model, optim, _ = ca.compose(ca.amp("fp16"))(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader_of(data))
    x, y = data[0]
    optim.backward(lm_loss(model(x), y))
    first = next(p for p in model.parameters() if p.grad is not None)
    first.grad.view(-1)[0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim.step()
    optim.zero_grad()
    assert optim.step_was_skipped
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    x, y = data[1]
    optim.backward(lm_loss(model(x), y))
    optim.step()
    optim.zero_grad()
    assert not optim.step_was_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_half_bf16_with_master_weights_is_closer_to_fp32_than_pure_bf16():
    data = batches(10)
    ref_model, _ = train(None, data, lr=1e-4)
    master, _ = train(ca.half("bf16", master_weights=True), data, lr=1e-4)
    pure, _ = train(ca.half("bf16", master_weights=False), data, lr=1e-4)
    ref = dict(ref_model.named_parameters())

    def err(m):
        return sum((p.float() - ref[n]).abs().sum().item() for n, p in m.named_parameters())

    assert next(master.parameters()).dtype == torch.bfloat16
    assert err(master) < err(pure)


def test_checkpoint_gradients_equal_on_cuda():
    x, y = batches(1)[0]
    plain = gpt()
    ckpt = copy.deepcopy(plain)
    ckpt, _, _ = ca.compose(ca.checkpoint(Block))(ckpt, torch.optim.SGD(ckpt.parameters(), lr=0.1), loader_of([(x, y)]))
    lm_loss(plain(x), y).backward()
    lm_loss(ckpt(x), y).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_compile_matches_eager_on_cuda():
    pytest.importorskip("triton")
    data = batches(3)
    _, ref = train(None, data, optim_cls=torch.optim.SGD)
    _, got = train(ca.compile(), data, optim_cls=torch.optim.SGD)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-3, atol=1e-3)


def test_module_replace_swaps_attention_and_keeps_the_loss():
    data = batches(2)
    _, ref = train(None, data, optim_cls=torch.optim.SGD)
    model = gpt()
    plan = ca.compose(ca.module_replace())
    applied = plan(model, torch.optim.SGD(model.parameters(), lr=1e-3), loader_of(data))
    assert [type(b.attn).__name__ for b in applied[0].blocks] != ["CausalSelfAttention"] * CFG.n_layer
    assert "CausalSelfAttention ->" in plan.explain(applied=applied)
    _, got = train(ca.module_replace(), data, optim_cls=torch.optim.SGD)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-4)


def _init_world_of_one():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)


def test_fsdp_world_one_on_nccl_equals_plain_torch():
    _init_world_of_one()
    data = batches(4)
    for optim_cls in (torch.optim.SGD, torch.optim.AdamW):
        _, ref = train(None, data, optim_cls=optim_cls)
        _, got = train(ca.parallel_mode([("data", 1)]) | ca.fsdp(wrap=(Block,)), data, optim_cls=optim_cls)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-5)


def test_fp8_torchao_tracks_bf16_on_fp8_tensor_cores():
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm89+")
    # fp8 swaps Linear layers whose dimensions are multiples of 16; the GPT's are
    data = batches(8)
    _, bf16 = train(ca.amp("bf16"), data)
    plan = ca.compose(ca.fp8(backend="torchao"), ca.amp("bf16"))
    assert "fp8" in plan.names, plan.explain()
    _, got = train(ca.fp8(backend="torchao") | ca.amp("bf16"), data)
    # fp8 numerics: the loss curves stay within 5% of bf16's over 8 steps (torchao's own bar is looser)
    assert all(abs(a - b) < 5e-2 * abs(a) for a, b in zip(bf16, got)), (bf16, got)


def test_transformer_engine_backend_when_installed():
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("transformer-engine fp8 needs sm89+")
    data = batches(4)
    _, bf16 = train(ca.amp("bf16"), data)
    _, got = train(ca.fp8(backend="transformer_engine") | ca.amp("bf16"), data)
    assert all(abs(a - b) < 5e-2 * abs(a) for a, b in zip(bf16, got)), (bf16, got)


def test_sdpa_flash_kernel_is_what_runs_in_bf16():
    """SDPA picks flash (or memory-efficient) attention for bf16 on the GPU, not the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

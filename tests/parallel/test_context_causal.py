"""context_parallel's all-gather rotation on a causal model attends each of the rank's two chunks with
torch's lower-right CausalBias (on CUDA the flash kernel's causal mode, no mask held) and never builds
the ``(local queries, all keys)`` mask; a sliding window keeps that exact masked path. Both train equal
to one process (fp32, SGD and AdamW, atol 1e-4) at world 2, the causal Llama also at world 4.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.overrides import TorchFunctionMode

import _seq
import composable_atorch as ca
import equivalence as eq
from composable_atorch.transforms.parallel.sequence import attention
from zoo.sequence import SEQ, build

from _dist import module_world, run_world

ATOL = 1e-4
_seq.MODELS.setdefault("zoo_mistral", functools.partial(build, "mistral"))


class _Masks(TorchFunctionMode):
    """The mask of every scaled_dot_product_attention call: ``("bias", q_len, kv_len)`` for a
    CausalBias, ``("tensor", shape)`` for a tensor, None for none."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if isinstance(mask, CausalBias):
                self.seen.append(("bias", mask.seq_len_q, mask.seq_len_kv))
            else:
                self.seen.append(None if mask is None else ("tensor", tuple(mask.shape)))
        return func(*args, **kwargs)


def _train_watched(model_name: str, optim_name: str, n: int) -> tuple:
    """:func:`_seq.run` of context_parallel over ``n`` ranks, with the training steps' attention masks
    and the shapes of every dense mask :func:`attention.visible` built."""
    m = _seq.MODELS[model_name]()
    plan = ca.compose(ca.parallel_mode([("context", n)]), ca.context_parallel())
    model, opt, data = plan(m, _seq.make_optim(m, optim_name), _seq.loader())
    dense, visible = [], attention.visible

    def watched_visible(q_pos, k_pos, causal, window):
        dense.append((len(q_pos), len(k_pos)))
        return visible(q_pos, k_pos, causal, window)

    attention.visible = watched_visible
    try:
        with _Masks() as masks:
            losses, shapes = eq.train(model, opt, data, _seq.seq_loss, _seq.STEPS)
    finally:
        attention.visible = visible
    return {"params": eq.plain(eq.full_params(model)), "losses": losses, "shapes": shapes}, masks.seen, dense


CASES_2 = [("llama", "sgd"), ("llama", "adamw"), ("user", "adamw"), ("zoo_mistral", "sgd"), ("zoo_mistral", "adamw")]


def _world2(rank, world):
    return {case: _train_watched(*case, 2) for case in CASES_2}


world2 = module_world(_world2, 2)


def _chunk_biases(rank: int, n: int) -> set:
    """The lower-right biases of rank ``rank``'s two chunks: ``(chunk, chunk end)`` each."""
    s = SEQ // (2 * n)
    return {("bias", s, (rank + 1) * s), ("bias", s, (2 * n - rank) * s)}


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name", CASES_2[:3])
def test_causal_attends_chunks_without_a_dense_mask(world2, model_name, optim_name):
    _seq.check([{0: r[(model_name, optim_name)][0]} for r in world2], 0, model_name, optim_name, ATOL)
    for rank, results in enumerate(world2):
        _, masks, dense = results[(model_name, optim_name)]
        assert dense == [], dense  # visible() never ran in a training step
        assert masks and set(masks) == _chunk_biases(rank, 2), masks


@pytest.mark.dist
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_sliding_window_keeps_the_exact_path(world2, optim_name):
    key = ("zoo_mistral", optim_name)
    _seq.check([{0: r[key][0]} for r in world2], 0, "zoo_mistral", optim_name, ATOL)
    for results in world2:
        _, masks, dense = results[key]
        assert dense and set(dense) == {(SEQ // 2, SEQ)}, dense  # (local queries, all keys)
        assert masks and set(masks) == {("tensor", (SEQ // 2, SEQ))}, masks


def _world4(rank, world):
    return _train_watched("llama", "adamw", 4)


@pytest.mark.dist
def test_causal_chunks_at_world_4():
    results = run_world(_world4, 4)
    _seq.check([{0: r[0]} for r in results], 0, "llama", "adamw", ATOL, shape=(_seq.BATCH, SEQ // 4))
    for rank, (_, masks, dense) in enumerate(results):
        assert dense == [] and set(masks) == _chunk_biases(rank, 4), (rank, masks, dense)


def test_lower_right_is_torchs_causal_lower_right():
    """The storage-free bias computes what torch's factory's does (rectangular and square), and can be
    made under FakeTensorMode, where the factory cannot."""
    torch.manual_seed(0)
    for q_len, kv_len in ((4, 12), (5, 5)):
        q, k, v = torch.randn(2, 3, q_len, 8), torch.randn(2, 3, kv_len, 8), torch.randn(2, 3, kv_len, 8)
        ours = F.scaled_dot_product_attention(q, k, v, attn_mask=attention.lower_right(q_len, kv_len))
        torchs = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, kv_len))
        assert torch.equal(ours, torchs)
    with FakeTensorMode():
        q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8)
        assert F.scaled_dot_product_attention(q, k, k, attn_mask=attention.lower_right(4, 12)).shape == q.shape

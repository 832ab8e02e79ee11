"""context_parallel(rotation="ring"): keys and values passed around the context group with online-softmax
merging. The ring kernel equals scaled_dot_product_attention over the whole sequence (outputs and
gradients, causal and not, world 2 and 3), and training equals one process (fp32, SGD and AdamW,
atol 1e-4) on a plain user model and a tiny transformers Llama at sequence 64, world 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import _seq
import composable_atorch as ca
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.sequence.attention import Attend
from composable_atorch.transforms.parallel.sequence.shard import chunk_positions

from _dist import module_world, run_world

ATOL = 1e-4
HALF = (_seq.BATCH, _seq.SEQ // 2)  # half of each sequence per rank


def kernel_errors(rank, world):
    """Max differences of the ring's output and q/k/v gradients from SDPA over the whole sequence."""
    import torch.distributed as dist

    from composable_atorch.transforms.parallel.sequence import ring
    from composable_atorch.transforms.parallel.sequence.ring import ring_attention

    errors, original = {}, ring._flash
    for causal, flash in ((True, True), (False, True), (True, False), (False, False)):
        ring._flash = lambda q, flash=flash: flash  # CPU flash kernel, or the plain matmul blocks
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(2, 3, 8 * world, 4) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref.backward(dout)
        index = chunk_positions(rank, world, 8, True)
        part = [t.detach().index_select(2, index).requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*part, dist.group.WORLD, rank, world, causal=causal)
        out.backward(dout.index_select(2, index))
        diffs = [(out - ref.detach().index_select(2, index)).abs().max().item()]
        diffs += [(p.grad - t.grad.index_select(2, index)).abs().max().item() for p, t in zip(part, (q, k, v))]
        errors[(causal, flash)] = max(diffs)
    ring._flash = original
    return errors


CASES = [(m, o) for m in ("user", "llama") for o in ("sgd", "adamw")]


def _world2(rank, world):
    out = {"kernel": kernel_errors(rank, world)}
    for model_name, optim_name in CASES:
        out[(model_name, optim_name)] = _seq.run(
            model_name, optim_name, ca.parallel_mode([("context", 2)]), ca.context_parallel(rotation="ring")
        )
    out["llama_checkpoint"] = _seq.run(
        "llama",
        "adamw",
        ca.parallel_mode([("context", 2)]),
        ca.context_parallel(rotation="ring"),
        ca.checkpoint("LlamaDecoderLayer"),
    )
    return out


world2 = module_world(_world2, 2)


@pytest.mark.dist
def test_ring_kernel_equals_sdpa_over_the_whole_sequence(world2):
    for rank in (0, 1):
        for causal, err in world2[rank]["kernel"].items():
            assert err < 1e-5, (rank, causal, err)


@pytest.mark.dist
def test_ring_kernel_at_world_3():  # the next and previous ranks differ
    for rank, errors in enumerate(run_world(kernel_errors, 3)):
        for causal, err in errors.items():
            assert err < 1e-5, (rank, causal, err)


@pytest.mark.dist
@pytest.mark.parametrize("model_name,optim_name", CASES)
def test_ring_context_2_equals_one_process(world2, model_name, optim_name):
    got = _seq.check(world2, (model_name, optim_name), model_name, optim_name, ATOL, shape=HALF)
    assert "passed around a ring" in got["explain"]


@pytest.mark.dist
def test_ring_with_checkpoint(world2):
    _seq.check(world2, "llama_checkpoint", "llama", "adamw", ATOL)


def test_ring_refusals():
    with pytest.raises(ConfigError, match="'allgather' or 'ring'"):
        ca.context_parallel(rotation="ulysses")
    attend = Attend(kind="context", group=None, rank=0, n=2, who="context_parallel", rotation="ring")
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ConfigError, match="rotation='allgather'"):
        attend(q, q, q, causal=True, dropout=0.1)

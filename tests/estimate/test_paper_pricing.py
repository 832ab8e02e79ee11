"""Pricing on paper: the overlap laws of the two-stream timeline, the pipeline bubbles per schedule,
the collectives' model, MFU / HFU by hand, and the estimate's paper fields (issue 37, items 2 and 3)."""

from __future__ import annotations

import math

import pytest
import torch

from composable_atorch.estimate.paper import comm, ops, schedules, timeline
from composable_atorch.estimate.paper.fusion import fuse
from composable_atorch.estimate.paper.price import Setting, policy, with_buckets
from composable_atorch.estimate.paper.timeline import Slot
from composable_atorch.estimate.paper.trace import Event
from composable_atorch.estimate.paper.utilization import attention_flops, lookup_free_params, utilization
from composable_atorch.hardware import get


def C(s, backward=False):
    return Slot("compute", s, s, backward=backward)


def M(s, policy):
    return Slot("comm", s, policy=policy)


# -- the timeline (the overlap laws without contention, then contention alone) -----------------------
def run(slots):
    return timeline.run(slots, contention=0.0)


def test_a_collective_under_enough_compute_costs_nothing():
    t = run([C(1.0), M(0.4, "async"), C(1.0), Slot("barrier"), C(0.1)])
    assert t.total == pytest.approx(2.1) and t.exposed == pytest.approx(0.0)


def test_compute_beside_a_collective_is_slowed_by_the_contention():
    slots = [C(1.0), M(0.4, "async"), C(1.0), Slot("barrier"), C(0.1)]
    t = timeline.run(slots)  # the reduction runs 0.4 s under the second block's compute
    assert t.total == pytest.approx(2.1 + timeline.CONTENTION * 0.4)
    assert t.exposed == pytest.approx(timeline.CONTENTION * 0.4)
    # sticking out: only the 0.2 s under compute is slowed; two collectives at once count once
    out = timeline.run([C(1.0), M(0.4, "async"), C(0.2), Slot("barrier"), C(0.1)])
    assert out.total == pytest.approx(1.0 + 0.4 + 0.1 + timeline.CONTENTION * 0.2)
    both = timeline.run([C(1.0), M(0.4, "async"), M(0.4, "next"), C(1.0), Slot("barrier")])
    assert both.total == pytest.approx(2.0 + timeline.CONTENTION * 0.4)
    assert timeline.overlap([(0, 1), (1, 2), (2, 3)], [(0.5, 2.5), (0.7, 0.9), (4, 5)]) == pytest.approx(2.0)


def test_only_what_sticks_out_is_exposed():
    t = run([C(1.0), M(1.5, "async"), C(0.2), Slot("barrier"), C(0.1)])
    # the reduction starts at 1.0 and ends at 2.5; the optimizer waits for it
    assert t.exposed == pytest.approx(2.5 - 1.2) and t.total == pytest.approx(2.6)


def test_a_blocking_collective_is_exposed_whole():
    t = run([C(1.0), M(0.3, "blocking"), C(1.0)])
    assert t.total == pytest.approx(2.3) and t.exposed == pytest.approx(0.3)


def test_a_prefetched_gather_hides_under_the_block_before():
    # FSDP: gather(block 1) issued before block 1's compute, overlapping block 0's (which started at 0)
    hidden = run([M(0.2, "prefetch"), C(1.0), M(0.5, "prefetch"), C(1.0)])
    assert hidden.exposed == pytest.approx(0.2)  # only the first gather has nothing to hide under
    late = run([M(0.2, "prefetch"), C(1.0), M(1.5, "prefetch"), C(1.0)])
    assert late.exposed == pytest.approx(0.2 + (0.2 + 1.5 - 1.2))


def test_ring_sends_overlap_the_next_block():
    t = run([M(0.5, "next"), C(1.0), M(0.5, "next"), C(1.0), M(0.0, "next"), C(0.1)])
    assert t.exposed == pytest.approx(0.0) and t.total == pytest.approx(2.1)
    slow = run([M(1.5, "next"), C(1.0), M(0.0, "next"), C(1.0)])
    assert slow.exposed == pytest.approx(0.5)


def test_gathers_and_reductions_run_on_their_own_streams():
    t = run([C(1.0), M(1.0, "async"), M(0.3, "prefetch"), C(1.0), Slot("barrier")])
    assert t.exposed == pytest.approx(0.0)  # the gather did not queue behind the reduction


def test_ddp_buckets_fill_over_the_last_backward():
    slots = [C(1.0), C(1.0, True), C(1.0, True), Slot("barrier"), C(0.1)]
    out = with_buckets(slots, [0.5, 0.5])
    kinds = [s.kind for s in out]
    assert kinds == ["compute", "compute", "comm", "compute", "comm", "barrier", "compute"]
    assert run(out).exposed == pytest.approx(0.5)  # the last bucket only starts at the end


def test_policies_follow_the_mesh_dimension():
    ev = lambda kind, dim: Event(kind, size=1.0, dim=dim)  # noqa: E731
    assert policy(ev("all_gather", "data"), False) == "prefetch"
    assert policy(ev("reduce_scatter", "zero"), False) == "async"
    assert policy(ev("all_reduce", "tensor"), False) == "blocking"
    assert policy(ev("all_to_all", "expert"), False) == "blocking"
    assert policy(ev("p2p", "context"), False) == "next"
    assert policy(ev("p2p_recv", "pipeline"), False) == "blocking"
    assert policy(ev("p2p", "pipeline"), False) == "async"
    assert policy(ev("all_gather", "data"), True) == "blocking"  # after the optimizer: the update is needed


# -- the pipeline bubble ----------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_per_schedule(p):
    c = schedules.Chunks(forward=1.0, backward=2.0, weight=1.0)
    assert schedules.bubble("1F1B", p, 1, c) == pytest.approx((p - 1) * 3.0)
    assert schedules.bubble("GPipe", p, 1, c) == pytest.approx((p - 1) * 3.0)
    assert schedules.bubble("Interleaved1F1B", p, 2, c) == pytest.approx((p - 1) * 3.0 / 2)
    assert schedules.bubble("ZBVZeroBubble", p, 2, c) == pytest.approx((p - 1) * (0.5 + 1.0 - 2 * 0.5))
    assert schedules.bubble("DualPipeV", p, 2, c) == pytest.approx((p - 1) * (1.5 + 1.0 - 1.5))
    assert schedules.bubble("1F1B", 1, 1, c) == 0.0
    # the share of the busy time: (p - 1) / m for 1F1B over m micro-batches of 3 s
    m = 16
    assert schedules.bubble("1F1B", p, 1, c) / (m * 3.0) == pytest.approx((p - 1) / m)


def test_zero_bubble_never_goes_below_zero():
    assert schedules.bubble("InterleavedZeroBubble", 4, 1, schedules.Chunks(1.0, 1.0, 5.0)) == 0.0
    with pytest.raises(ValueError):
        schedules.bubble("Unknown", 2, 1, schedules.Chunks(1, 1, 1))


# -- kernels and collectives ---------------------------------------------------------------------------
def test_gemm_is_compute_bound_when_large_and_floored_when_tiny():
    h100 = get("h100-sxm")
    flops = 2 * 8192**3
    seconds, _ = ops.gemm(h100, "bfloat16", flops, 3 * 8192**2 * 2)
    assert seconds == pytest.approx(flops / (989.4e12 * 0.803))
    assert ops.gemm(h100, "bfloat16", 2.0, 6.0)[0] == h100.launch_s
    assert ops.gemm(h100, "float8", flops, 0)[0] < seconds / 1.5  # fp8 units


def test_causal_attention_costs_half():
    h100 = get("h100-sxm")
    full = ops.attention(h100, "bfloat16", 1e12, backward=False, causal=False, seq=4096, mask=False)[0]
    half = ops.attention(h100, "bfloat16", 1e12, backward=False, causal=True, seq=4096, mask=False)[0]
    masked = ops.attention(h100, "bfloat16", 1e12, backward=False, causal=False, seq=4096, mask=True)[0]
    assert half == pytest.approx(full / 2) and masked > full


def test_collectives_ring_factors_and_links():
    h100 = get("h100-sxm")
    big = 2.0**30
    ar = comm.collective_s(h100, "all_reduce", big, tuple(range(8)), 8)
    ag = comm.collective_s(h100, "all_gather", big, tuple(range(8)), 8)
    assert ar == pytest.approx(2 * 7 / 8 * big / (450e9 * 1.0), rel=0.02)  # plus NCCL's ring latency
    assert ag == pytest.approx(7 / 8 * big / (450e9 * 0.8), rel=0.02)
    across = comm.collective_s(h100, "all_gather", big, tuple(range(16)), 8)  # 2 nodes, 8 NICs each
    assert across > comm.collective_s(h100, "all_gather", big, tuple(range(8)), 8)
    one_per_node = comm.collective_s(h100, "all_gather", big, (0, 8), 8)
    assert one_per_node == pytest.approx(0.5 * big / (50e9 * 0.85), rel=0.02)
    assert comm.collective_s(h100, "all_reduce", big, (3,), 8) == 0.0
    tiny = comm.collective_s(h100, "all_reduce", 8.0, tuple(range(8)), 8)
    assert 5e-6 < tiny < 1e-4  # NCCL's latency, not bandwidth


def test_a_ring_across_nodes_runs_on_the_nodes_nics_together_as_nccl_tests_measures():
    """Two nodes of 8 A100s with 4 x 200 Gb/s HDR each (12.5 GB/s per GPU): nccl-tests' all-reduce bus
    bandwidth was measured at 86 GB/s (NVIDIA/nccl-tests#175), 91 GB/s (#100), 85-96 GB/s (#119 at
    three nodes). Pricing each rank at its own NIC alone would say 12.5 GB/s."""
    a100 = get("a100-80gb-sxm").with_network(12.5e9, "4 x 200 Gb/s HDR per node of 8")
    size = 2.0**30
    for nodes in (2, 3):
        n = 8 * nodes
        seconds = comm.collective_s(a100, "all_reduce", size, tuple(range(n)), 8)
        busbw = 2 * (n - 1) / n * size / seconds
        assert 75e9 < busbw < 100e9, (nodes, busbw / 1e9)
    # one rank per node (hybrid sharding's replicate group) has one NIC: 8 times slower per byte
    one_each = size / comm.collective_s(a100, "all_reduce", size, (0, 8), 8)  # bus bandwidth, 2 ranks
    assert 9e9 < one_each < 12.5e9


# -- compile's fusion rule ------------------------------------------------------------------------------
def test_fusion_reads_inputs_and_writes_outputs_once():
    a, b, c = (1, 100.0), (2, 100.0), (3, 100.0)
    events = [
        Event("mm", "bfloat16", 1e9, 300.0),
        Event("memory", "bfloat16", 200.0, reads=(a,), writes=(b,)),
        Event("memory", "bfloat16", 200.0, reads=(b,), writes=(c,)),
        Event("all_gather", size=10.0),
        Event("memory", "bfloat16", 200.0, reads=(c,), writes=((4, 100.0),)),
    ]
    out = fuse(events)
    assert [e.kind for e in out] == ["mm", "memory", "all_gather", "memory"]
    assert out[1].size == 200.0  # read a, write c (b never leaves the kernel)
    assert sum(e.size for e in out if e.kind == "memory") < sum(e.size for e in events if e.kind == "memory")
    assert sum(e.size for e in out if e.kind == "mm") == 1e9  # FLOPs untouched


# -- MFU / HFU -----------------------------------------------------------------------------------------
def test_mfu_and_hfu_by_hand():
    n, tokens, world, seconds, peak = 7e9, 8 * 4096, 8, 2.0, 312e12
    attention = 12 * 32 * 4096 * 4096 * tokens  # PaLM: 12 L H Q T, counted whole
    u = utilization(
        seconds=seconds,
        world=world,
        tokens=tokens,
        params=int(n),
        attention_per_stage=[attention / world],
        flops_per_stage=[8e15],
        peak=peak,
        peak_dtype="bfloat16",
    )
    model = 6 * int(n) * tokens + attention
    assert u.model_flops == pytest.approx(model)
    assert u.mfu == pytest.approx(model / world / seconds / peak)
    assert u.hfu == pytest.approx(8e15 / seconds / peak)
    assert u.tokens_per_s_per_device == pytest.approx(tokens / world / seconds)


def test_attention_model_flops_from_the_backward_calls():
    # torch's counter: a backward is 2.5 forwards, so the model's 3 forwards are 1.2 backwards
    fwd = 4 * 2 * 8 * 128 * 128 * 64
    assert attention_flops({("sdpa_bwd", "bfloat16", 2.5 * fwd): 2}) == pytest.approx(2 * 3 * fwd)


def test_embedding_lookups_are_not_model_flops():
    emb, head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100, bias=False)
    model = torch.nn.Sequential(emb, torch.nn.Linear(8, 8), head)
    assert lookup_free_params(model) == 8 * 8 + 8 + 800
    head.weight = emb.weight  # tied: the head's matmul is real, counted once
    assert lookup_free_params(model) == 8 * 8 + 8 + 800


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "user"])
def test_stacked_experts_count_at_their_active_share(name):
    """MFU counts the parameters a token multiplies (torchtitan's active parameters): top_k of
    num_experts stacked experts, the router and shared experts whole. Over all experts, a
    Mixtral-shaped plan on 8 H100s read an MFU of 145%."""
    from composable_atorch.transforms.parallel.expert.families import follows_protocol
    from zoo import moe

    model = moe.build(name)
    experts = [m for m in model.modules() if follows_protocol(m)]
    assert experts
    stacked = sum(p.numel() for m in experts for p in m.parameters())
    k = 2  # the zoo's top-k for these families
    dense = sum(p.numel() for p in model.parameters()) - stacked
    lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    tied = any(
        m.weight is e.weight
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        for e in model.modules()
        if isinstance(e, torch.nn.Embedding)
    )
    expected = dense - (0 if tied else lookups) + stacked * k / experts[0].num_experts
    assert lookup_free_params(model) == pytest.approx(expected)


def test_grouped_expert_gemms_are_counted_and_priced():
    """transformers 5's experts run one grouped GEMM (torch's _grouped_mm, or its custom-op fallback
    whose fake kernel runs no matmul); torch's flop counter knows neither, so the experts' FLOPs and
    time were left out of the step: a Mixtral-shaped plan on 8 H100s read HFU 16% beside MFU 47%."""
    import composable_atorch as ca
    from composable_atorch.estimate import estimate
    from composable_atorch.estimate.kernels import grouped_flops as _grouped_flops
    from zoo import moe

    tokens, w = torch.empty(12, 8), torch.empty(4, 8, 16)
    assert _grouped_flops("grouped_mm_fallback", (tokens, w)) == 2 * 12 * 8 * 16
    assert _grouped_flops("grouped_mm_fallback_backward", (tokens, w)) == 4 * 12 * 8 * 16
    assert _grouped_flops("_grouped_mm", (torch.empty(8, 12), torch.empty(12, 16))) == 2 * 8 * 12 * 16
    assert _grouped_flops("_grouped_mm", (torch.empty(4, 3, 8), w)) == 2 * 4 * 3 * 8 * 16
    env = ca.Environment.detect().with_(world_size=1, device="cuda", compute_capability=(9, 0))
    shape = torch.Size([4, 32])
    est = estimate(
        ca.compose(env=env),
        lambda: moe.build("mixtral"),
        {"input_ids": shape, "labels": shape},
        world_size=1,
        device="cuda",
        hardware="h100-sxm",
    )
    # no recompute: what the device runs is what the model counts (the router's and the head's
    # GEMMs and the softmax-free rest aside), within a few percent
    assert est.hfu == pytest.approx(est.mfu, rel=0.1), (est.hfu, est.mfu)


def test_setting_nodes():
    s = Setting(get("h100-sxm"), world=64, nodes=8)
    assert s.per_node == 8 and math.isclose(Setting(get("l4"), world=4).per_node, 4)


def test_a_barrier_with_nothing_in_flight():
    assert run([C(1.0), Slot("barrier"), C(1.0)]).total == pytest.approx(2.0)


def test_a_one_dimensional_mesh_on_the_default_group_keeps_its_dimension():
    from composable_atorch.estimate.paper.price import slots_of

    events = [Event("all_reduce", size=2.0**20, ranks=(0, 1)), Event("mm", "bfloat16", 1e9, 1e6)]
    tensor = slots_of(events, Setting(get("h100-sxm"), world=2, world_dim="tensor"))[0]
    data = slots_of(events, Setting(get("h100-sxm"), world=2))[0]
    assert tensor[0].policy == "blocking" and data[0].policy == "async"


def test_the_ordered_trace_names_each_tensor_once_even_when_python_reuses_its_id():
    """Compile's fusion rule reads which tensors a run of ops wrote and read; a freed tensor's ``id()``
    is reused by the next one, which made one plan price differently from run to run (the torchtitan
    CP 1 row: 7.92-8.38 s). Every op here writes a new tensor: no two writes may share a name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from composable_atorch.estimate.paper.trace import OrderedTrace

    with FakeTensorMode():
        x = torch.randn(64, 64)
        trace = OrderedTrace()
        with trace:
            for _ in range(50):
                a = x + 1  # freed two lines on: its id is free for a later tensor (seen: 21 of 150 reused)
                x = torch.tanh(a) * 2
                del a
    writes = [w for ev in trace.events for w, _ in ev.writes]
    assert len(writes) == len(set(writes)) == 150

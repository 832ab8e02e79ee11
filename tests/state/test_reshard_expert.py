"""An expert-parallel run resumes at another expert degree, plan and world: experts resharded, every sample once.

Each expert rank writes its experts as its rows of the whole ``[E, ...]`` tensor (fsdp-sharded
experts as their sub-rows): a checkpoint of expert 2 loads at expert 1 (ddp, fsdp, no plan in one
process) and the other way, and expert 2 x fsdp 2 at world 4 to and from both. The expert dimension
is a batch dimension, so the data position (global samples consumed) carries over as for any data
split. Each run is compared with one plain process on the run's global order: each step's sample ids
exactly, its loss and the final weights (the last checkpoint opened in one process) to fp32
reduction order, SGD and AdamW (moments resharded with the experts). Expert x fsdp saves asynchronously.

The phases run in three spawned groups (world 2, world 4, world 2) and this process (no process
group: ``a``'s one-process phase), see _resharding.py.
"""

from __future__ import annotations

import collections
import functools
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import composable_atorch as ca
import equivalence as eq
from _resharding import Indexed, one_process_loader, reference_run, run_all, train_phase
from composable_atorch.errors import ConfigError
from composable_atorch.state.hf import save_pretrained
from zoo import moe as mm

SAMPLES, BATCH, TOTAL = 16, 4, 6  # 4 steps per epoch: the run crosses into epoch 1
OPTIMIZERS = eq.EXPERT
PLANS = {
    "ep": lambda: ca.compose(ca.parallel_mode([("expert", 2)]), ca.expert_parallel()),
    "ep_data": lambda: ca.compose(ca.parallel_mode([("expert", 2), ("data", 2)]), ca.expert_parallel()),
    "ep_fsdp": lambda: ca.compose(ca.parallel_mode([("expert", 2), ("data", 2)]), ca.expert_parallel(), ca.fsdp()),
    "ep_fsdp_1": lambda: ca.compose(ca.parallel_mode([("expert", 2), ("data", 1)]), ca.expert_parallel(), ca.fsdp()),
    "ddp": lambda: ca.compose(ca.ddp()),
    "fsdp": lambda: ca.compose(ca.fsdp()),
    "plain": None,  # no plan, one process, no process group
}
#: case -> (model, [(world, plan, first step, last step)]): each phase saves at its last step, the next loads it
CASES = {
    "a": ("user", [(2, "ep", 1, 2), (1, "plain", 3, 4), (2, "ep", 5, 6)]),
    "b": ("user", [(2, "fsdp", 1, 2), (4, "ep_fsdp", 3, 4), (2, "ddp", 5, 6)]),
    "c": ("user", [(4, "ep_fsdp", 1, 2), (2, "ep", 3, 4), (2, "fsdp", 5, 6)]),
    "d": ("user", [(4, "ep_data", 1, 3), (2, "ep_fsdp_1", 4, 6)]),  # ddp's data replicas write their experts once
    "mixtral": ("mixtral", [(2, "ep_fsdp_1", 1, 3), (4, "ep_fsdp", 4, 6)]),
}


loss_fn = eq.shifted_ce


def dataset():
    return Indexed(SAMPLES, mm.SEQ, mm.VOCAB, low=1)


def loader():
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


@functools.cache
def reference(name: str, opt: str):
    """One process, plain torch, on the run's global batches: (losses, ids per step, final weights)."""
    m = mm.build(name)
    return reference_run(m, OPTIMIZERS[opt](m.parameters()), dataset(), BATCH, TOTAL, lambda b: (b[1], b[1]), loss_fn)


def run_phase(case: str, opt: str, directory: str, plan_name: str, first: int, last: int) -> dict:
    """Apply the phase's plan, load the previous phase's checkpoint, train to ``last``, save."""
    # phase 1 starts from the reference's weights; later phases from others: all must come from the checkpoint
    m = mm.build(CASES[case][0], seed=0 if first == 1 else first)
    optim = OPTIMIZERS[opt](m.parameters())
    if PLANS[plan_name] is None:
        data = one_process_loader(dataset(), BATCH)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m, optim, data = PLANS[plan_name]()(m, optim, loader())
    where = f"{directory}/{case}-{opt}"

    def train(batch):
        ids, tokens = batch
        return ca.train_step(m, optim, tokens, tokens, loss_fn), ids.tolist()

    record = train_phase(m, optim, data, where, first, last, train)
    # expert x fsdp saves asynchronously: DCP stages the (expert, data)-mesh views, then writes on a thread
    saved = ca.save_state(where, m, optim, data, step=last, asynchronous=plan_name.startswith("ep_fsdp"))
    if hasattr(saved, "wait"):
        saved.wait()  # before the group is destroyed (the next phase's load_state would wait too)
    if case == "mixtral":  # the shipped artefact: every expert, gathered from the expert ranks
        save_pretrained(m, f"{where}-hf-{last}")
    held = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in m.named_parameters()}
    return {"record": record, "held": held}


def group(rank, world, work, directory):
    return {
        (case, index, opt): run_phase(case, opt, directory, *CASES[case][1][index][1:])
        for case, index in work
        for opt in OPTIMIZERS
    }


def open_in_one_process(directory: str, name: str, opt: str):
    """The checkpoint's weights in the plain model, one process (every expert whole)."""
    m = mm.build(name, seed=99)
    ca.load_state(directory, m, OPTIMIZERS[opt](m.parameters()), verbose=False)
    return {n: p.detach().numpy() for n, p in m.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's phases: (checkpoint directory, {(case, phase index, opt): per-rank results})."""
    directory = str(tmp_path_factory.mktemp("reshard_expert"))
    return directory, run_all({case: phases for case, (_, phases) in CASES.items()}, group, directory)


@pytest.mark.dist
def test_expert_runs_resume_at_other_expert_degrees_with_experts_resharded_and_every_sample_once(runs):
    directory, results = runs

    for case, (name, phases) in CASES.items():
        whole = {n: p.numel() for n, p in mm.build(name).named_parameters()}
        for opt in OPTIMIZERS:
            ref_losses, ref_ids, ref_params = reference(name, opt)
            steps = []
            for index, (world, plan, _, _) in enumerate(phases):
                per_rank = results[(case, index, opt)]
                assert len(per_rank) == world, (case, plan)
                for i in range(len(per_rank[0]["record"])):
                    step = per_rank[0]["record"][i][0]
                    seen = collections.Counter(x for r in per_rank for x in r["record"][i][2])
                    assert set(seen.values()) == {1}, (case, opt, plan, step, seen)  # expert x data split the batch
                    steps.append((step, float(np.mean([r["record"][i][1] for r in per_rank])), sorted(seen)))
                if plan.startswith("ep"):  # each rank held 1/world of each experts tensor (1/2 at expert 2 x data 1)
                    share = 4 if plan == "ep_fsdp" else 2
                    experts = [n for n in whole if ".experts." in n]
                    assert experts and all(per_rank[0]["held"][n] * share == whole[n] for n in experts), (case, plan)
            assert [s for s, _, _ in steps] == list(range(1, TOTAL + 1)), case
            # no sample skipped or repeated across the resumes: each step's batch is the uninterrupted run's
            assert [ids for _, _, ids in steps] == ref_ids, (case, opt)
            gaps = [abs(loss - ref) for (_, loss, _), ref in zip(steps, ref_losses, strict=True)]
            assert max(gaps) < 1e-4, (case, opt, gaps)
            params = open_in_one_process(f"{directory}/{case}-{opt}", name, opt)
            assert sorted(params) == sorted(ref_params)
            worst = max(float(np.abs(params[n] - ref_params[n]).max()) for n in ref_params)
            assert worst < 1e-4, (case, opt, worst)


@pytest.mark.dist
def test_a_parameter_the_new_model_lacks_is_named_before_anything_changes(runs):
    """Saved at expert 2 (case a) and at expert 2 x fsdp 2 (Mixtral); opened into a model without the
    head's bias, one with a block less, and a one-layer Mixtral: a ConfigError naming the parameters,
    with the weights and the optimizer as they were."""
    import transformers

    directory, _ = runs

    def one_layer_mixtral():
        config = mm.CONFIGS["mixtral"]()
        config.num_hidden_layers = 1
        return transformers.AutoModelForCausalLM.from_config(config)

    def without_bias():
        m = mm.build("user", seed=5)
        m.head = torch.nn.Linear(32, mm.VOCAB, bias=False)
        return m

    def block_less():
        m = mm.build("user", seed=5)
        del m.blocks[1]
        return m

    for make, case, missing in (
        (without_bias, "a", "head.bias"),
        (block_less, "a", "blocks.1.experts.w_in"),
        (one_layer_mixtral, "mixtral", "model.layers.1.mlp.experts.down_proj"),
    ):
        m = make()
        optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(ConfigError, match="not in the model") as err:
            ca.load_state(f"{directory}/{case}-sgd", m, optim, verbose=False)
        assert missing in str(err.value), str(err.value)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items()) and not optim.state


@pytest.mark.dist
def test_save_pretrained_of_an_expert_parallel_model_ships_every_expert(runs):
    """Mixtral saved as a Hugging Face directory at expert 2 x fsdp 1 (world 2) and expert 2 x fsdp 2
    (world 4): from_pretrained in one process holds the weights the checkpoint of that step holds."""
    import transformers

    directory, _ = runs
    for opt in OPTIMIZERS:
        for _, plan, _, last in CASES["mixtral"][1]:
            shipped = transformers.AutoModelForCausalLM.from_pretrained(f"{directory}/mixtral-{opt}-hf-{last}")
            want = open_in_one_process(f"{directory}/mixtral-{opt}/step-{last:08d}", "mixtral", opt)
            got = {n: p.detach().numpy() for n, p in shipped.named_parameters()}
            assert sorted(got) == sorted(want), plan
            assert all(np.array_equal(got[n], want[n]) for n in want), (plan, opt)


def test_experts_a_checkpoint_cannot_place_are_refused_naming_why_before_any_work(tmp_path):
    """Experts sharded over a mesh that is not made of the plan's dimensions (fully_shard called by hand
    on a mesh of one's own) have no place in the whole tensor: save_state and load_state name them and
    why, and write or change nothing. (Stand-ins for the meshes: no process group needed to refuse.)"""
    from types import SimpleNamespace

    from composable_atorch.transforms.parallel.expert.transform import SHARD_ATTR, ExpertShard

    root = SimpleNamespace(mesh_dim_names=("data", "expert"))
    expert_mesh = SimpleNamespace(mesh_dim_names=("expert",), _get_root_mesh=lambda: root)
    m = mm.build("user")
    experts = m.blocks[0].experts
    setattr(experts, SHARD_ATTR, ExpertShard(2, 0, 4, 8, None, expert_mesh))
    experts.w_in.placements, experts.w_in.device_mesh = (), SimpleNamespace(mesh_dim_names=("mine",))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for call in (lambda: ca.save_state(tmp_path / "ckpt", m, step=1), lambda: ca.load_state(tmp_path, m)):
        with pytest.raises(ConfigError, match="expert-parallel") as err:
            call()
        assert "blocks.0.experts.w_in (its fsdp mesh ('mine',) is not made of the plan's mesh dimensions" in str(
            err.value
        )
    assert not list(tmp_path.iterdir())
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())

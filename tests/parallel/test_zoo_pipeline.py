"""pipeline_parallel on the model zoo: every decoder-only architecture and the plain user model cut
into 2 stages at world 2 (real gloo), trained 3 steps with SGD and with AdamW, against one process
on the same global batches; encoder-decoders are refused with the reason (encoders:
test_pipeline_encoders.py).

The last stage outputs logits and the criterion computes the loss (HF causal LMs shift the labels
inside their forward; here the criterion shifts, and the reference uses the same criterion, which
is checked against the model's own ``labels=`` loss once).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import composable_atorch as ca
import equivalence as eq
import zoo
from composable_atorch.errors import ConfigError
from composable_atorch.transforms.parallel.pipeline import UncuttableModelError

from _dist import run_world

STEPS, TOL = 3, 1e-4
CASES = [n for n in zoo.ZOO if zoo.KIND[n] in ("decoder", "plain")]
OPTIMS = eq.PIPELINE


def criterion(name):
    """The user model's loss (zoo.zoo_loss) is every position against its own token; the families'
    the next token (as an HF causal LM computes it from ``labels=ids``)."""
    return eq.token_ce if name == "user" else eq.shifted_ce


def _model(name):
    return zoo.build(name).eval()  # dropout off: both runs compute the same function


def _data(name):
    return [zoo.batch(name, seed=s) for s in range(STEPS)]


def _reference(name, opt):
    model = _model(name)
    data = _data(name)
    own = zoo_gap = 0.0
    if name != "user":  # the criterion is the family's own loss
        with torch.no_grad():
            own = zoo.zoo_loss(name, model, data[0]).item()
            zoo_gap = abs(own - eq.shifted_ce(model(input_ids=data[0]).logits, data[0]).item())
    wrapped = model if name == "user" else eq.Logits(model)
    optim = OPTIMS[opt](model.parameters())
    losses = [ca.train_step(wrapped, optim, x, x, criterion(name)) for x in data]
    return {"losses": losses, "params": eq.numpy_params(model, remove_duplicate=False), "zoo_gap": zoo_gap}


def _pipelined(name, opt, split="auto"):
    model = _model(name)
    plan = ca.compose(ca.pipeline_parallel(microbatches=2, split=split), ca.parallel_mode([("pipeline", 2)]))
    applied = plan(model, OPTIMS[opt](model.parameters()))
    model, optim, _ = applied
    losses = [ca.train_step(model, optim, x, x, criterion(name)) for x in _data(name)]
    return {
        "losses": losses,
        # numpy: torch tensors would travel back to the test through shared memory, one descriptor each
        "params": eq.numpy_params(model),
        "explain": plan.explain(applied=applied),
    }


def _world(rank, world):
    jobs = [(n, o) for n in CASES for o in OPTIMS]
    mine = {f"{n}/{o}": _pipelined(n, o) for n, o in jobs}
    mine["llama/sgd/split-path"] = _pipelined("llama", "sgd", split=["layers.1"])
    # the one-process references, half on each rank
    refs = {f"{n}/{o}": _reference(n, o) for n, o in eq.mine(rank, world, jobs)}
    return mine, refs


@pytest.mark.dist
def test_zoo_pipeline_matches_one_process():
    (r0, refs0), (r1, refs1) = run_world(_world, 2, timeout=900)
    refs = {**refs0, **refs1}
    refs["llama/sgd/split-path"] = refs["llama/sgd"]
    bad = {}
    for case, ref in refs.items():
        a, b = r0[case], r1[case]
        problems = []
        if ref["zoo_gap"] > 1e-5:
            problems.append(f"criterion differs from the model's own loss by {ref['zoo_gap']}")
        # the two stages together hold every parameter (a tied weight on both), each equal to one process's
        names = set(a["params"]) | set(b["params"])
        if names != set(ref["params"]) or set(a["params"]) & set(b["params"]):
            problems.append(
                f"stage names {sorted(names ^ set(ref['params']))} / shared {set(a['params']) & set(b['params'])}"
            )
            bad[case] = problems
            continue
        stages = [(r["losses"], r["params"]) for r in (a, b)]
        gap, weight, same, _ = eq.stage_gaps(stages, ref["losses"], ref["params"])
        if not same:
            problems.append("stages report different losses")
        if gap > TOL:
            problems.append(f"loss gap {gap}")
        if weight > TOL:
            problems.append(f"weight gap {weight}")
        start = _model(case.split("/")[0]).named_parameters()
        moved = max(float(abs(ref["params"][n] - p.detach().numpy()).max()) for n, p in start)
        if moved < 1e-3:
            problems.append("the reference did not train (the comparison could not fail)")
        if problems:
            bad[case] = problems
    assert not bad, bad
    assert "tied" in r0["gpt2/sgd"]["explain"] and "probe forward" in r0["opt/sgd"]["explain"]
    assert "base_model_pp_plan" in r0["phi/sgd"]["explain"]


def test_seq2seq_is_refused_with_the_reason_and_encoders_are_cut():
    with pytest.raises(UncuttableModelError, match="encoder-decoder has two block stacks") as err:
        ca.pipeline_parallel().cuts(zoo.build("t5"), 2)
    assert "Fix: train it with ddp" in str(err.value)
    assert ca.pipeline_parallel().cuts(zoo.build("bert"), 2) == (1,)  # an encoder is a chain (test_pipeline_encoders)


class _Skip(nn.Module):
    """A user model whose forward is no chain: every block reads the embeddings (a skip to each block)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(zoo.VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, zoo.VOCAB)

    def forward(self, x):
        e = self.embed(x)
        return self.head(sum(block(e) for block in self.blocks))


def test_models_that_cannot_be_cut_name_the_fix():
    with pytest.raises(UncuttableModelError, match="as a chain") as err:
        ca.pipeline_parallel().cuts(_Skip(), 2)
    assert "split=" in str(err.value)
    with pytest.raises(UncuttableModelError, match="found none"):
        ca.pipeline_parallel().cuts(nn.Linear(2, 2), 2)
    with pytest.raises(ConfigError, match="names no module"):
        ca.pipeline_parallel(split=["nowhere.1"]).cuts(zoo.build("user"), 2)
    with pytest.raises(ConfigError, match="at least as many blocks"):  # 2 ranks x 2 stages > 2 blocks
        ca.pipeline_parallel(schedule="Interleaved1F1B").cuts(zoo.build("user"), 2)
    assert ca.pipeline_parallel(schedule="Interleaved1F1B").cuts(zoo.UserModel(layers=4), 2) == (1, 2, 3)


def test_split_by_path_and_plain_sequential():
    user = zoo.UserModel(layers=4)
    assert ca.pipeline_parallel(split=["blocks.3"]).cuts(user, 2) == (3,)
    assert ca.pipeline_parallel().cuts(user, 2) == (2,)  # balanced: head and tail weigh about the same
    chain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert ca.pipeline_parallel(split=[2]).cuts(chain, 2) == (2,)
    assert ca.pipeline_parallel(split=["2"]).cuts(chain, 2) == (2,)
    copy.deepcopy(chain)  # cutting decides only: the model is untouched
    assert len(chain) == 5

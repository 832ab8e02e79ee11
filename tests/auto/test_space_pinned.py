"""The search space, pinned: the set of distinct valid plans (and why a degree was not proposed) for
representative workloads (GPT at world 2, a long-sequence Llama at world 4, a MoE at world 4 on one
and on two nodes), recorded from the search as it stood and asserted equal since.

Moving where a degree is decided (the search, a transform's ``candidates()``) must not change which
plans are searched. ``space_pins.json`` beside this file holds, per case, a digest of each valid
plan's key (``plan_key``: its ordered steps and configs), the notes and the knobs (the sampler's
parameters: names, labels, order). Regenerate it only for a
change meant to alter the space:

    PYTHONPATH=src python tests/auto/test_space_pinned.py --write
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from composable_atorch.auto.policy import SpaceOptions  # noqa: E402
from composable_atorch.auto.space import build_space  # noqa: E402
from composable_atorch.auto.workload import GPTTask, Workload  # noqa: E402
from composable_atorch.data import TextDataset  # noqa: E402
from composable_atorch.environment import Environment  # noqa: E402

PINS = os.path.join(HERE, "space_pins.json")
#: a sequence long enough to be split over 4 ranks (context chunks of 2 x 4 tokens, Ulysses' 4 heads)
LONG = 256


def llama():
    """transformers' Llama from its config (defaults on): attention with position_ids, 4 heads, GQA."""
    from zoo.configs import cfg, shape

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(
        cfg("LlamaConfig", **shape(64, num_key_value_heads=2), max_position_embeddings=LONG)
    )


def hf_loss(model, batch):
    tokens, targets = batch
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def moe():
    from zoo.moe import UserMoEModel

    torch.manual_seed(0)
    return UserMoEModel(vocab=256)


def lm_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def case(name: str):
    """``(workload, environment, space options)`` of one pinned case."""
    long, short = TextDataset(LONG, limit=16), TextDataset(16, limit=16)
    if name == "gpt-world2":
        return GPTTask(limit=32).workload(), Environment(world_size=2), SpaceOptions()
    if name == "llama-long-world4":
        return Workload(llama, sgd, long, hf_loss, 8), Environment(world_size=4), SpaceOptions()
    if name == "moe-world4":
        return Workload(moe, sgd, short, lm_loss, 8), Environment(world_size=4), SpaceOptions()
    if name == "moe-world4-2nodes":
        return Workload(moe, sgd, short, lm_loss, 8), Environment(world_size=4, nodes=2), SpaceOptions()
    # a pinned kind (no "absent" option), and a sequence split forced on short sequences
    if name == "moe-world4-2nodes-included-parallel_mode":
        options = SpaceOptions(included=("parallel_mode",), excluded=("checkpoint", "amp"))
        return Workload(moe, sgd, short, lm_loss, 8), Environment(world_size=4, nodes=2), options
    if name == "llama-short-world2-included-ulysses":
        options = SpaceOptions(included=("sequence_parallel",), excluded=("checkpoint",))
        return Workload(llama, sgd, short, hf_loss, 4), Environment(world_size=2), options
    raise KeyError(name)


CASES = (
    "gpt-world2",
    "llama-long-world4",
    "moe-world4",
    "moe-world4-2nodes",
    "moe-world4-2nodes-included-parallel_mode",
    "llama-short-world2-included-ulysses",
)


def space_of(name: str) -> dict:
    workload, env, options = case(name)
    space, _ = build_space(workload, env, options)
    enumeration = space.enumerate()
    return {
        "plans": {digest(key): point.plan.names for key, point in enumeration.valid.items()},
        "notes": sorted(space.degrees.notes),
        "knobs": [[knob, list(choices)] for knob, choices in space.options.items()],
    }


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", CASES)
def test_the_space_is_the_pinned_one(name):
    with open(PINS) as f:
        pinned = json.load(f)[name]
    got = space_of(name)
    missing = sorted(set(pinned["plans"]) - set(got["plans"]))
    extra = [got["plans"][key] for key in sorted(set(got["plans"]) - set(pinned["plans"]))]
    assert not missing and not extra, f"{len(missing)} plans gone ({missing[:3]}), {len(extra)} new: {extra[:3]}"
    assert got["notes"] == pinned["notes"]
    assert got["knobs"] == pinned["knobs"]  # the sampler's parameters: knob names, labels and their order


if __name__ == "__main__" and "--write" in sys.argv:
    with open(PINS, "w") as f:
        pins = {name: space_of(name) for name in CASES}
        json.dump({n: {**p, "plans": sorted(p["plans"])} for n, p in pins.items()}, f, indent=1)
        f.write("\n")

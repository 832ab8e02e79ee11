"""expert_parallel (expert 2, world 2) on MoE families beyond tests/moe_models.py, built from their
transformers 5 configs (tiny, defaults on): each rank holds half of every experts module and training
equals one process (fp32, SGD and AdamW, atol 1e-4) — the machinery of test_expert_parallel, over
:mod:`zoo.moe`'s families. Families whose experts do not follow the protocol (Llama-4's batched
experts, JetMoE's mixture of attention heads) are a typed ExpertParallelError naming the modules.
PhiMoE is split (its experts follow the protocol) but not compared: its sparsemixer router samples
(``exponential_``, ``rand_like``) in training, so no split of the batch draws one process's routing.
"""

from __future__ import annotations

import pytest
import test_expert_parallel as tep

import moe_models as mm
from composable_atorch.transforms.parallel.expert.families import ExpertParallelError, find_experts
from zoo import moe as zm

from _dist import run_world

_plain_build = mm.build


def _build(name: str, seed: int = 0, vocab: int = mm.VOCAB):
    return zm.build(name, seed) if name in zm.CONFIGS else _plain_build(name, seed, vocab)


mm.build = _build  # test_expert_parallel builds its models through moe_models.build (also in the children)

SPLIT = [
    "olmoe",
    "qwen2_moe_plain",
    "qwen3_moe_sparse_step",
    "granitemoe",
    "granitemoeshared",
    "deepseek_v2",
    "jamba",
    "glm4_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "minimax",
    "flex_olmo",
]
CASES = [(n, "sgd", (("expert", 2), ("data", 1)), None) for n in SPLIT]
CASES += [(n, "adamw", (("expert", 2), ("data", 1)), None) for n in ("olmoe", "glm4_moe", "deepseek_v2")]


def _world(rank, world, cases):
    return {case: tep._case(*case) for case in cases}


@pytest.mark.dist
def test_expert_2_trains_each_zoo_family_as_one_process():
    results = run_world(_world, 2, CASES, timeout=900)
    failures = tep._check(results, CASES)
    assert not failures, failures


@pytest.mark.parametrize(("name", "words"), [("llama4_text", "Llama4TextExperts"), ("jetmoe", "JetMoe")])
def test_families_outside_the_protocol_are_refused(name, words):
    with pytest.raises(ExpertParallelError, match=words):
        find_experts(zm.build(name), 2)

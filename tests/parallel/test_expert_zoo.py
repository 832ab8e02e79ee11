"""expert_parallel (expert 2, world 2) on MoE families beyond its first four (tests/zoo/moe.py), built from their
transformers 5 configs (tiny, defaults on): each rank holds half of every experts module and training
equals one process (fp32, SGD and AdamW, atol 1e-4) — the machinery of test_expert_parallel, over
the rest of :mod:`zoo.moe`. Families whose experts do not follow the protocol (Llama-4's batched
experts, JetMoE's mixture of attention heads) are a typed ExpertParallelError naming the modules.
PhiMoE is split (its experts follow the protocol) but not compared: its sparsemixer router samples
(``exponential_``, ``rand_like``) in training, so no split of the batch draws one process's routing.
"""

from __future__ import annotations

import pytest
import test_expert_parallel as tep

from composable_atorch.transforms.parallel.expert.families import ExpertParallelError, find_experts
from zoo import moe as zm

from _dist import run_world

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


@pytest.mark.dist
def test_expert_2_trains_each_zoo_family_as_one_process():
    results = run_world(tep._world, 2, CASES, timeout=900)
    failures = tep._check(results, CASES)
    assert not failures, failures


@pytest.mark.parametrize(("name", "words"), [("llama4_text", "Llama4TextExperts"), ("jetmoe", "JetMoe")])
def test_families_outside_the_protocol_are_refused(name, words):
    with pytest.raises(ExpertParallelError, match=words):
        find_experts(zm.build(name), 2)

"""The committed prediction of seed 002's table (benchmarks/paper_table.py's JSON): every row within 15%.

A prediction check on the committed numbers, not a timing: the benchmark itself recomputes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "paper_table.json"


@pytest.fixture(scope="module")
def rows():
    if not RESULTS.exists():
        pytest.skip("benchmarks/results/paper_table.json not written yet (python benchmarks/paper_table.py)")
    return json.loads(RESULTS.read_text())["seed002"]["rows"]


def test_every_row_within_15_percent(rows):
    assert len(rows) == 14
    for r in rows:
        assert abs(r["tflops_error"]) <= 0.15 and abs(r["hfu_error"]) <= 0.15, r
        if r["kind"] == "fsdp":
            assert abs(r["memory_error"]) <= 0.05, r


def test_each_family_keeps_the_published_order(rows):
    families: dict = {}
    for r in rows:
        families.setdefault((r["kind"], r["lora"], r["tp"], r["pp"]), []).append(r)
    for family in families.values():
        by_pub = sorted(family, key=lambda r: r["published_tflops"])
        by_pred = sorted(family, key=lambda r: r["predicted_tflops"])
        assert [r["world"] for r in by_pub] == [r["world"] for r in by_pred], family

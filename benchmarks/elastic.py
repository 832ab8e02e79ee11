"""An elastic job that loses a node and gains one: how often does it recover, and what does each change cost?

    python benchmarks/elastic.py [--runs 5] [--shared-store]

Runs the scenario of tests/cli/test_elastic_launch.py ``--runs`` times (tests/scripts/
elastic_scenario.py): four one-process nodes under ``launch --nnodes 3:4 --last-call 1
--node-timeout 3``, fsdp on a tiny model saving every 2 steps; node 3 is SIGKILLed inside step 4,
the job goes on at world 3, a node joins again at step 7 and the job ends at world 4. A run
counts as recovered when every launcher left exits 0 and the trained history equals the
uninterrupted run's (every sample once per epoch, each step's loss and the final weights within
fp32 tolerance). For each run it reports the seconds from the SIGKILL to the first step at world
3 and from the new node's start to the first step at world 4, and the median seconds of a
training step and of a ``save_state`` (what the save cadence trades). ``--shared-store`` sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0`` (torchrun's default: one store for every round) to
compare with launch's store per round.

``--last-call`` / ``--node-timeout`` change the rendezvous waits (launch's defaults are 10 and 15).
Saves benchmarks/results/elastic.json (elastic_shared_store.json, ..._last_call10_node_timeout15.json).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

import elastic_scenario as sc  # noqa: E402

#: the lines of a failed node's log that say why
ERROR = re.compile(r"EADDRINUSE|refused|Timeout|timed out|Error:|connectFullMesh")


def equal_to_reference(run: dict, out: Path, reference) -> bool:
    want_losses, want_state, want_batches = reference
    history = sc.history(run["records"])
    if sc.rounds_of(run["records"]) != sc.ROUNDS:
        return False
    for step, got in history.items():
        if sorted(i for r in got for i in r["ids"]) != want_batches[step - 1]:
            return False
        loss = sum(r["loss"] for r in got) / len(got)
        if abs(loss - want_losses[step - 1]) > 1e-5 * abs(want_losses[step - 1]) + 1e-6:
            return False
    final = load_file(out / "final.safetensors")
    return final.keys() == want_state.keys() and all(
        torch.allclose(final[k], want_state[k], rtol=1e-5, atol=1e-6) for k in final
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--shared-store", action="store_true")
    p.add_argument("--last-call", type=int, default=1, help="launch --last-call (launch's default: 10)")
    p.add_argument("--node-timeout", type=int, default=3, help="launch --node-timeout (launch's default: 15)")
    ns = p.parse_args()
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"} if ns.shared_store else {}
    reference = sc.reference_run()
    outcomes, steps, saves = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(ns.runs):
            tmp = Path(d) / f"run{i}"
            try:
                run = sc.run(tmp, env_changes=env, last_call=ns.last_call, node_timeout=ns.node_timeout)
            except sc.ScenarioError as exc:
                cause = str(exc).splitlines()[0]
                errors = [line.strip()[:200] for line in str(exc).splitlines() if ERROR.search(line)]
                if errors:
                    cause += f": {errors[0]}"
                outcomes.append({"recovered": False, "error": cause})
                print(f"run {i + 1}: FAILED ({cause})", flush=True)
                continue
            records = run["records"]
            first = {k: min(r["time"] for r in records if (r["start"], r["world"]) == k) for k in sc.rounds_of(records)}
            ok = equal_to_reference(run, tmp / "out", reference)
            outcome = {
                "recovered": ok,
                "failure_to_first_step_s": round(first.get((2, 3), float("nan")) - run["killed_at"], 1),
                "join_to_first_step_s": round(first.get((6, 4), float("nan")) - run["grown_at"], 1),
            }
            outcomes.append(outcome)
            steps += [r["step_s"] for r in records]
            saves += [r["save_s"] for r in records if r["save_s"] is not None]
            print(f"run {i + 1}: {'recovered, equal to the reference' if ok else 'NOT equal'} {outcome}", flush=True)
    recovered = [o for o in outcomes if o["recovered"]]
    summary = {
        "shared_store": ns.shared_store,
        "recovered": len(recovered),
        "runs": outcomes,
        "median_failure_to_first_step_s": statistics.median(o["failure_to_first_step_s"] for o in recovered)
        if recovered
        else None,
        "median_join_to_first_step_s": statistics.median(o["join_to_first_step_s"] for o in recovered)
        if recovered
        else None,
        "median_step_s": round(statistics.median(steps), 4) if steps else None,
        "median_save_s": round(statistics.median(saves), 4) if saves else None,
        "launch": f"--nnodes 3:4 --nproc 1 --last-call {ns.last_call} --node-timeout {ns.node_timeout} "
        "--max-restarts 3, saving every 2 steps",
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    name = "elastic_shared_store" if ns.shared_store else "elastic"
    if (ns.last_call, ns.node_timeout) != (1, 3):
        name += f"_last_call{ns.last_call}_node_timeout{ns.node_timeout}"
    (ROOT / "benchmarks" / "results" / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()

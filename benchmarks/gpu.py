"""One prepared run on one GPU (issue 31): the CUDA paths run, and the numbers users compare are measured.

    python benchmarks/gpu.py [--out benchmarks/results/gpu.json] [--size 1b] [--seq 2048] [--batch auto]
                             [--parts tests,estimate,throughput,search] [--search-s 180] [--budget-s 480]

On a machine without CUDA it checks its arguments, says so and exits 0 (nothing is measured, no JSON
is written). On a GPU, in at most ``--budget-s`` seconds (each part is skipped, with the reason in the
JSON, once the budget cannot hold it):

1. ``tests``: the suite's CUDA-marked tests (``pytest -m cuda tests/gpu``), their pass / fail counts.
2. ``estimate``: ``composable_atorch.estimate`` on each library plan *before* it runs (per-rank peak
   memory, and the step priced on paper twice: with the catalog's figures for this card, and with
   its curves calibrated here by ``calibration(device="cuda")``); then each plan trained alone for a
   few steps: ``torch.cuda.max_memory_allocated`` and the median step: paper vs calibrated vs measured.
3. ``throughput``: a transformers Llama of about 1B parameters (TinyLlama's shape), sequence 2048,
   AdamW: plain torch (fp32), HF Accelerate ``mixed_precision="bf16"`` and the library's plans
   (``amp``, ``amp | checkpoint``, ``+ compile``, ``+ fp8`` where torchao and sm89+ are there). Each
   contender is trained *in the same process as Accelerate bf16, in alternating blocks* (two models
   resident, never six: six 1B models with AdamW state do not fit 80 GB), so what the clock does
   falls on both alike; its ratio to Accelerate is read off the same pair. MFU against the card's
   published dense bf16 peak (:data:`PEAK_BF16`), model FLOPs per token = 6 N + 12 L d s (PaLM's
   appendix B, attention counted without the causal halving, as torchtitan and Megatron report it).
4. ``search``: the library's search (what ``auto_accelerate`` without a strategy runs) at world 1 with
   a ``--search-s`` budget: its pick, and the pick's throughput against Accelerate bf16 in one pair.

The device image has torch, transformers, accelerate and peft but not optuna or torchao: carry their
wheels (``benchmarks/gpu_wheels.sh`` downloads them into ``.gpu_wheels/``); a part whose package is
missing is skipped with that reason, never faked. Writes ``--out`` (JSON) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
PARTS = ("tests", "estimate", "throughput", "search")

#: Published dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a substring of the device name.
#: Checked in order: the first match wins (so "H100 PCIe" before "H100").
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM / HBM3
    ("H200", 989.4e12),
    ("H800", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362.05e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165.2e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The card's published dense bf16 peak, or None for a card this table does not know."""
    for key, flops in PEAK_BF16:
        if key.lower() in device_name.lower():
            return flops
    return None


@dataclass(frozen=True)
class LlamaShape:
    """A transformers Llama's shape; ``params()`` and ``flops_per_token()`` are analytic (no model built)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def params(self) -> int:
        d, i, kv = self.hidden, self.intermediate, self.kv_heads * (self.hidden // self.heads)
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * i + 2 * d  # q, o; k, v; gate, up, down; two norms
        return self.layers * per_layer + 2 * self.vocab * d + d  # untied embedding and head, final norm

    def flops_per_token(self, seq: int) -> float:
        """6 N (forward + backward of every weight, embedding lookup excluded) + 12 L d s (attention)."""
        n = self.params() - self.vocab * self.hidden  # the embedding is a lookup, not a matmul
        return 6.0 * n + 12.0 * self.layers * self.hidden * seq

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )


SIZES = {
    "1b": LlamaShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000),  # TinyLlama
    "tiny": LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256),  # CPU tests
}


def mfu(tokens_per_s: float, shape: LlamaShape, seq: int, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s * shape.flops_per_token(seq) / peak


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / "results" / "gpu.json")
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", default="auto", help="per-step batch, or 'auto' (the largest of 1..16 that fits)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--block", type=int, default=4, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=3, help="blocks per contender (alternating with Accelerate)")
    p.add_argument("--search-s", type=float, default=180.0)
    p.add_argument("--budget-s", type=float, default=480.0)
    args = p.parse_args(argv)
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        p.error(f"--parts: unknown {bad or 'empty'}; choose from {','.join(PARTS)}")
    args.parts = parts
    if args.batch != "auto":
        try:
            args.batch = int(args.batch)
        except ValueError:
            p.error("--batch: a positive integer or 'auto'")
        if args.batch < 1:
            p.error("--batch: a positive integer or 'auto'")
    for name in ("seq", "block", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: a positive integer")
    if args.search_s <= 0 or args.budget_s <= 0:
        p.error("--search-s and --budget-s: positive seconds")
    return args


# ---------------------------------------------------------------------------------------------- plans


def library_plans(block_cls, capability: tuple[int, int] | None, have_torchao: bool) -> dict:
    """The library's plans measured against the peers, and why any was left out (name -> plan or reason)."""
    import composable_atorch as ca

    plans = {
        "amp": ca.amp("bf16"),
        "amp|checkpoint": ca.amp("bf16") | ca.checkpoint(block_cls),
        "amp|checkpoint|compile": ca.amp("bf16") | ca.checkpoint(block_cls) | ca.compile(),
    }
    if not have_torchao:
        plans["amp|checkpoint|fp8"] = "skipped: torchao is not installed (carry its wheel: benchmarks/gpu_wheels.sh)"
    elif capability is None or tuple(capability) < (8, 9):
        plans["amp|checkpoint|fp8"] = f"skipped: fp8 tensor cores need sm89+, this card is {capability}"
    else:
        plans["amp|checkpoint|fp8"] = ca.amp("bf16") | ca.checkpoint(block_cls) | ca.fp8(backend="torchao")
    return plans


class Tokens:
    """Seeded random token windows (no download): (input_ids,) with labels = input_ids, as HF trains."""

    def __init__(self, vocab: int, seq: int, n: int = 4096, seed: int = 0):
        self.vocab, self.seq, self.n, self.seed = vocab, seq, n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab, (self.seq,), generator=g)


def hf_loss(model, batch):
    """The loss a transformers user writes: labels = input_ids, the model shifts them."""
    return model(input_ids=batch, labels=batch).loss


# ------------------------------------------------------------------------------------------ contenders


def _build(shape: LlamaShape):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the card: a 1B model's CPU init would cost ~15 s a build
        return AutoModelForCausalLM.from_config(shape.config(), attn_implementation="sdpa")


def contender(name: str, plan, shape: LlamaShape, seq: int, batch: int):
    """``step()`` training one step of ``name`` on the GPU; returns (step, cleanup)."""
    import torch

    data = Tokens(shape.vocab, seq)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)
    model = _build(shape)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if name == "torch fp32":

        def backward(loss):
            loss.backward()
    elif name == "accelerate bf16":
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision="bf16")
        model, optim, loader = acc.prepare(model, optim, loader)
        backward = acc.backward
    else:
        import composable_atorch as ca

        model, optim, loader = ca.compose(plan)(model, optim, loader)
        backward = optim.backward

    batches = _endless(loader)

    def step():
        x = next(batches).cuda(non_blocking=True)
        loss = hf_loss(model, x)
        backward(loss)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss

    def cleanup():
        nonlocal model, optim
        del model, optim
        torch.cuda.empty_cache()

    return step, cleanup


def _endless(loader):
    while True:
        yield from loader


def timed_block(step, n: int) -> float:
    """Seconds for ``n`` steps, between CUDA events (the device's clock, not the host's)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    if not math.isfinite(float(loss)):
        raise RuntimeError(f"non-finite loss {float(loss)}")
    return start.elapsed_time(end) / 1000.0


def pick_batch(shape: LlamaShape, seq: int, plans: dict) -> int:
    """The largest batch of 1, 2, 4, 8, 16 at which plain torch fp32 and Accelerate both take a step resident
    together (the heaviest pair: no checkpointing), with 15% of the card left for the library's plans' extras."""
    import torch

    best = 1
    for b in (1, 2, 4, 8, 16):
        try:
            a, ca_ = contender("torch fp32", None, shape, seq, b), contender("accelerate bf16", None, shape, seq, b)
            torch.cuda.reset_peak_memory_stats()
            a[0]()
            ca_[0]()
            used = torch.cuda.max_memory_allocated() / torch.cuda.get_device_properties(0).total_memory
            a[1]()
            ca_[1]()
            if used > 0.85:
                break
            best = b
        except torch.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
    return best


def ab(name: str, plan, shape, seq, batch, block: int, rounds: int) -> dict:
    """``name`` and Accelerate bf16 in one process, alternating blocks; tokens/s of each and their ratio."""
    mine, mine_free = contender(name, plan, shape, seq, batch)
    peer, peer_free = contender("accelerate bf16", None, shape, seq, batch)
    try:
        for step in (mine, peer):  # warm-up: compile, autotune, allocator
            timed_block(step, 2)
        ts, tp = [], []
        for _ in range(rounds):
            ts.append(timed_block(mine, block))
            tp.append(timed_block(peer, block))
    finally:
        mine_free()
        peer_free()
    tokens = block * batch * seq
    mine_tps, peer_tps = tokens / statistics.median(ts), tokens / statistics.median(tp)
    return {
        "tokens_per_s": mine_tps,
        "accelerate_bf16_tokens_per_s": peer_tps,
        "vs_accelerate_bf16": mine_tps / peer_tps,
        "block_s": ts,
        "accelerate_block_s": tp,
    }


# ------------------------------------------------------------------------------------------------ parts


def run_tests(timeout: float) -> dict:
    junit = Path("/tmp/composable_atorch_gpu_junit.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "tests/gpu",
        f"--junitxml={junit}",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    counts = junit_counts(junit.read_text()) if junit.exists() else {}
    return {"returncode": proc.returncode, **counts, "tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def junit_counts(xml: str) -> dict:
    """pytest's junit XML -> {tests, failures, errors, skipped, passed}."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    n["failed_names"] = [
        f"{c.get('classname')}.{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return n


def card_hardware(calibrate: bool) -> dict:
    """The card's catalog entry (paper figures) and, with ``calibrate``, the same with its curves measured
    here (``calibration(device="cuda")``: GEMM, attention, memory; NCCL where there are 2+ GPUs)."""
    import torch

    from composable_atorch.hardware import for_device_name

    paper = for_device_name(torch.cuda.get_device_name())
    out = {"paper": paper}
    if calibrate and paper is not None:
        from composable_atorch.estimate.calibrate import calibration
        from composable_atorch.estimate.paper.calibrate import as_hardware

        try:
            out["calibrated"] = as_hardware(calibration(device="cuda"), paper)
        except Exception as exc:  # noqa: BLE001 - a calibration that fails is a finding
            out["calibration_error"] = f"{type(exc).__name__}: {exc}"[:400]
    return out


def run_estimates(plans: dict, shape: LlamaShape, seq: int, batch: int, steps: int = 4, calibrate: bool = True) -> dict:
    """Predicted (before running) vs measured peak memory and step time, each plan alone on the card: the
    step priced on paper with the catalog's figures for this card, with this card's calibrated curves,
    and measured."""
    import torch

    from composable_atorch.estimate import estimate

    cards = card_hardware(calibrate)
    out = {"calibration_error": cards["calibration_error"]} if "calibration_error" in cards else {}
    for name, plan in plans.items():
        if isinstance(plan, str):
            out[name] = {"skipped": plan}
            continue
        row: dict = {}
        for mode in ("paper", "calibrated"):
            if cards.get(mode) is None:
                continue
            try:
                est = estimate(
                    plan,
                    lambda: _meta_model(shape),
                    {"input_ids": torch.Size([batch, seq])},
                    world_size=1,
                    device="cuda",
                    loss_fn=_dict_loss,
                    hardware=cards[mode],
                )
                row.update(predicted_peak=est.peak)
                row["predicted_step_s" if mode == "paper" else "calibrated_step_s"] = est.step_time_s
            except Exception as exc:  # noqa: BLE001 - an estimate that fails is a finding, not a stop
                row[f"estimate_error_{mode}"] = f"{type(exc).__name__}: {exc}"[:400]
        step, free = contender(name, plan, shape, seq, batch)
        try:
            timed_block(step, 2)
            torch.cuda.reset_peak_memory_stats()
            times = [timed_block(step, 1) for _ in range(steps)]
            row.update(measured_peak=int(torch.cuda.max_memory_allocated()), measured_step_s=statistics.median(times))
        finally:
            free()
        for kind in ("peak", "step_s"):
            p, m = row.get(f"predicted_{kind}"), row.get(f"measured_{kind}")
            if p and m:
                row[f"{kind}_error"] = (p - m) / m
        c, m = row.get("calibrated_step_s"), row.get("measured_step_s")
        if c and m:
            row["calibrated_step_s_error"] = (c - m) / m
        out[name] = row
    return out


def _meta_model(shape: LlamaShape):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(shape.config(), attn_implementation="sdpa")


def _dict_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def gpu_model_fn():
    """The search's model factory (module level: trials run in fresh processes)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(SIZES[os.environ["CA_GPU_SIZE"]].config(), attn_implementation="sdpa")


def gpu_optim_fn(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_search(shape, seq, batch, seconds: float, args) -> dict:
    from composable_atorch.auto import Budget, StudyOptions, TrialSettings, Workload, search

    os.environ["CA_GPU_SIZE"] = args.size
    workload = Workload(gpu_model_fn, gpu_optim_fn, Tokens(shape.vocab, seq), hf_loss, batch)
    result = search(
        workload,
        trial=TrialSettings(world_size=1, timeout=max(60.0, seconds / 3)),
        budget=Budget(time_limit=seconds),
        study=StudyOptions(seed=0),
        progress=False,
    )
    pick = result.best_plan
    row = {"pick": None if pick is None else " | ".join(pick.names), "stopped_by": result.stopped_by}
    row["trials"] = [
        {
            "plan": t.plan_label(),
            "status": t.status,
            "samples_per_s": None if t.result is None else t.result.samples_per_s,
            "reason": t.reason,
        }
        for t in result.records
    ]
    if pick is not None:
        row["ab"] = ab("search pick", pick, shape, seq, batch, args.block, args.rounds)
    return row


# ------------------------------------------------------------------------------------------------- main


def environment_report() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for pkg in ("transformers", "accelerate", "optuna", "torchao", "peft"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 - absent or broken: reported as such
            info[pkg] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=list(torch.cuda.get_device_capability()),
            memory_bytes=props.total_memory,
            peak_bf16_flops=peak_bf16_flops(props.name),
        )
    return info


def table(result: dict) -> str:
    lines = [f"device: {result['env'].get('device')}  torch {result['env']['torch']}  CUDA {result['env']['cuda']}"]
    t = result.get("tests")
    if isinstance(t, dict) and "passed" in t:
        lines.append(f"CUDA tests: {t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped")
    thr = result.get("throughput", {})
    if thr.get("rows"):
        lines.append(f"{'contender':28} {'tokens/s':>10} {'MFU':>6} {'x accel bf16':>13}")
        for name, r in thr["rows"].items():
            if "skipped" in r or "error" in r:
                lines.append(f"{name:28} {r.get('skipped') or r.get('error')}")
                continue
            m = r.get("mfu")
            lines.append(
                f"{name:28} {r['tokens_per_s']:10.0f} {m * 100 if m else float('nan'):5.1f}% "
                f"{r['vs_accelerate_bf16']:12.2f}x"
            )
    for name, r in result.get("estimate", {}).items():
        if isinstance(r, dict) and "measured_peak" in r:
            pe, se, ce = (r.get(k) for k in ("peak_error", "step_s_error", "calibrated_step_s_error"))
            pe, se, ce = ("-" if v is None else f"{v:+.0%}" for v in (pe, se, ce))
            lines.append(f"estimate {name:24} peak {pe}  step: paper {se}, calibrated {ce} (vs measured)")
    s = result.get("search")
    if isinstance(s, dict) and "pick" in s:
        ratio = s.get("ab", {}).get("vs_accelerate_bf16")
        lines.append(f"search pick: {s['pick']}  {'' if ratio is None else f'{ratio:.2f}x Accelerate bf16'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py: no CUDA device here (torch {torch.__version__}); arguments checked, nothing "
            "measured, no JSON written. Run it on a GPU machine."
        )
        return 0
    t0 = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - t0)

    sys.path.insert(0, str(ROOT / "src"))
    from composable_atorch.environment import package_available

    shape = SIZES[args.size]
    result: dict = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": environment_report(),
        "shape": asdict(shape),
        "params": shape.params(),
    }
    if "tests" in args.parts:
        result["tests"] = run_tests(timeout=min(150.0, left() * 0.3))
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cap = tuple(result["env"]["capability"])
    plans = library_plans(LlamaDecoderLayer, cap, package_available("torchao"))
    batch = args.batch if args.batch != "auto" else pick_batch(shape, args.seq, plans)
    result["batch"] = batch
    if "estimate" in args.parts:
        result["estimate"] = run_estimates(plans, shape, args.seq, batch) if left() > 120 else {"skipped": "budget"}
    if "throughput" in args.parts:
        rows = {}
        peak = result["env"]["peak_bf16_flops"]
        for name, plan in {"torch fp32": None, **plans}.items():
            if isinstance(plan, str):
                rows[name] = {"skipped": plan}
            elif left() < 45:
                rows[name] = {"skipped": "budget spent"}
            else:
                try:
                    r = ab(name, plan, shape, args.seq, batch, args.block, args.rounds)
                    r["mfu"] = mfu(r["tokens_per_s"], shape, args.seq, peak)
                    r["accelerate_bf16_mfu"] = mfu(r["accelerate_bf16_tokens_per_s"], shape, args.seq, peak)
                    rows[name] = r
                except Exception as exc:  # noqa: BLE001 - a plan that breaks on the GPU is the finding
                    rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                    torch.cuda.empty_cache()
        result["throughput"] = {"rows": rows, "flops_per_token": shape.flops_per_token(args.seq)}
    if "search" in args.parts:
        if not package_available("optuna"):
            result["search"] = {"skipped": "optuna is not installed (carry its wheel: benchmarks/gpu_wheels.sh)"}
        elif left() < args.search_s + 60:
            result["search"] = {"skipped": f"budget: {left():.0f} s left, the search needs {args.search_s + 60:.0f}"}
        else:
            try:
                result["search"] = run_search(shape, args.seq, batch, args.search_s, args)
            except Exception as exc:  # noqa: BLE001
                result["search"] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    result["wall_s"] = time.monotonic() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

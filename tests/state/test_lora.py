"""peft LoRA under fsdp (seed 002's USE_LORA=1), at world 2, against the same LoRA model in one process.

* only the trainable (adapter) parameters are in the optimizer;
* gradients equal the one-process gradients on the same global batch (1e-6: reduction order);
* save_pretrained writes the adapter alone, and peft loads it back with the trained logits.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_world

pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = pytest.mark.dist


def lora_llama():
    from peft import LoraConfig, get_peft_model

    from test_hf_save import tiny_llama

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(tiny_llama(), cfg)


def trainable_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[n] = g.detach().clone()
    return out


def lora_cases(rank: int, world: int, out: str) -> dict:
    from peft import PeftModel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import composable_atorch as ca
    from composable_atorch.state.hf import save_pretrained

    from test_hf_save import batches, tiny_llama

    x = batches(1, batch=4)[0]
    ref = lora_llama()
    ref(input_ids=x, labels=x).loss.backward()
    reference = trainable_grads(ref)
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    results = {}
    for outmost in (True, False):
        model = lora_llama()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(trainable, lr=1e-2)
        plan = ca.compose(ca.fsdp(wrap=(LlamaDecoderLayer,), wrap_trainable_outmost=outmost))
        model, optim, _ = plan(model, optim, None)
        in_optim = [p for g in optim.param_groups for p in g["params"]]
        from torch.distributed.fsdp import FSDPModule

        # wrap_trainable_outmost: no fully_shard-ed block below the root holds a trainable parameter
        blocks_with_trainable = sum(
            1
            for m in model.modules()
            if isinstance(m, FSDPModule) and m is not model and any(p.requires_grad for p in m.parameters())
        )
        n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
        model(input_ids=x[rank::world], labels=x[rank::world]).loss.backward()
        grads = trainable_grads(model)
        gap = max(float((grads[n] - reference[n]).abs().max()) for n in reference)
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            logits = model(input_ids=probe).logits.float()
        path = save_pretrained(model, f"{out}/{outmost}")
        r = {
            "in_optim": len(in_optim),
            "n_trainable": n_trainable,
            "all_trainable": all(p.requires_grad for p in in_optim),
            "same_names": sorted(grads) == sorted(reference),
            "grad_gap": gap,
            "blocks_with_trainable": blocks_with_trainable,
        }
        if rank == 0:
            loaded = PeftModel.from_pretrained(tiny_llama(), str(path))
            with torch.no_grad():
                again = loaded(input_ids=probe).logits.float()
            from safetensors.torch import load_file

            r["files"] = sorted(p.name for p in path.iterdir())
            r["adapter_keys"] = sorted(load_file(str(path / "adapter_model.safetensors")))
            r["logits_gap"] = float((again - logits).abs().max())
        results[outmost] = r
    return results


def test_lora_under_fsdp_matches_one_process_and_saves_the_adapter(tmp_path):
    got = run_world(lora_cases, 2, str(tmp_path), timeout=300)
    for outmost in (True, False):
        for rank_result in got:
            r = rank_result[outmost]
            assert r["same_names"] and r["all_trainable"], r
            assert r["in_optim"] == r["n_trainable"] == 8, r  # 2 layers x (q, v) x (A, B)
            assert r["grad_gap"] < 1e-6, (outmost, r)
            assert (r["blocks_with_trainable"] == 0) == outmost, r  # outmost: adapters in the root group
        r = got[0][outmost]
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["files"]), r
        assert not any(f.startswith("model") for f in r["files"]), r  # the adapter alone, not the base
        assert len(r["adapter_keys"]) == 8 and all("lora_" in k for k in r["adapter_keys"]), r
        assert r["logits_gap"] < 1e-5, (outmost, r)

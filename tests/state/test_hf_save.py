"""save_pretrained: a model trained under fsdp / ddp / zero / tensor parallel at world 2 saved as a
Hugging Face directory.

The directory loads with ``from_pretrained`` in a fresh model and gives the trained model's logits.
"""

from __future__ import annotations

import pytest
import torch

from zoo.configs import llama_config

from _dist import run_world

pytest.importorskip("transformers")


def tiny_llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(num_key_value_heads=4, max_position_embeddings=64))


def batches(n: int = 3, batch: int = 4, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(n)]


def train_and_save(rank: int, world: int, out: str) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import composable_atorch as ca
    from composable_atorch.state.hf import save_pretrained

    gaps = {}
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    plans = {
        "fsdp": ca.fsdp(wrap=(LlamaDecoderLayer,)),
        "ddp": ca.ddp(),
        "zero1": ca.zero1(),
        "zero2": ca.zero2(),
        "tensor_parallel": ca.tensor_parallel(),
    }  # transformers' own Llama TP plan; DTensor weights gathered
    for name, plan in plans.items():
        # the data dimension is 1 under tensor parallelism: both ranks train on the same batch
        shard = slice(None) if name == "tensor_parallel" else slice(rank, None, world)
        model = tiny_llama()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optim, _ = ca.compose(plan)(model, optim, None)
        for x in batches():
            loss = model(input_ids=x[shard], labels=x[shard]).loss
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
        with torch.no_grad():
            logits = model(input_ids=probe).logits.float()
        path = save_pretrained(model, f"{out}/{name}")
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(path)
            with torch.no_grad():
                again = loaded(input_ids=probe).logits.float()
            files = sorted(p.name for p in path.iterdir())
            fresh = tiny_llama()
            with torch.no_grad():
                untrained = fresh(input_ids=probe).logits.float()
            gaps[name] = {
                "gap": float((again - logits).abs().max()),
                "moved": float((untrained - logits).abs().max()),
                "files": files,
            }
    return gaps


@pytest.mark.dist
def test_fsdp_ddp_zero_models_save_as_hf_directories_with_the_same_logits(tmp_path):
    got = run_world(train_and_save, 2, str(tmp_path), timeout=300)[0]
    for name in ("fsdp", "ddp", "zero1", "zero2", "tensor_parallel"):
        r = got[name]
        assert "config.json" in r["files"] and "model.safetensors" in r["files"], r
        assert r["moved"] > 1e-3, r  # training changed the model, so equality below means something
        assert r["gap"] < 1e-5, (name, r)


def test_single_process_plain_module_saves_safetensors_with_tied_weights(tmp_path):
    from safetensors.torch import load_file

    from composable_atorch.models import GPT
    from composable_atorch.state.hf import save_pretrained

    model = GPT()
    save_pretrained(model, tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    fresh = GPT()
    missing, unexpected = fresh.load_state_dict(saved, strict=False)
    assert not unexpected
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_save_pretrained_rejects_a_non_module(tmp_path):
    from composable_atorch.errors import ConfigError
    from composable_atorch.state.hf import save_pretrained

    with pytest.raises(ConfigError, match="torch.nn.Module"):
        save_pretrained({"w": 1}, tmp_path)

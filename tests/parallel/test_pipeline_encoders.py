"""pipeline_parallel on encoders and wrapped models at world 2, against one process (SGD and AdamW):
ViT and ConvNeXt image classifiers (no mask; ViT's forward has no ``inputs_embeds``), BERT and
DeBERTa-v2 masked LMs on padded batches (the attention mask travels between stages with the
activation; DeBERTa-v3-style relative attention: its position table, given to every layer, is
held by every stage, gradients summed) and on plain token tensors (the model builds its own float
mask; relative-position variants: buckets on / off, max_relative_positions, share_att_key,
norm_rel_ebd, c2p / p2c, position_biased_input), and a LoRA-wrapped Llama (peft: the base model is cut,
adapters stay in their layers, only they train). Encoder-decoders and two-tower models are refused with the true reason.
"""

from __future__ import annotations

import pytest
from torch import nn

import composable_atorch as ca
import equivalence as eq
from composable_atorch.transforms.parallel.pipeline import UncuttableModelError
from zoo import pipeline as zx

from _dist import run_world

STEPS, TOL = 3, 1e-4
OPTIMS = eq.PIPELINE
MODELS = {**{n: (lambda n=n: zx.encoder(n)) for n in zx.ENCODERS}, "lora_llama": zx.lora_llama}


def _batches(name):
    """(inputs, targets) per step: images and labels, or a padded text batch (dict) and its token targets."""
    out = []
    for s in range(STEPS):
        if name in ("vit", "convnext"):
            out.append((zx.images(s), zx.labels(s)))
        elif name in zx.UNPADDED:  # token ids alone, as a user feeds them: the model builds its own mask
            out.append((zx.batch(s), zx.batch(s)))
        else:
            b = zx.padded(s)
            out.append((b, b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)))
    return out


def loss_fn(logits, targets):
    if logits.dim() == 2:  # image classes
        return nn.functional.cross_entropy(logits.float(), targets)
    # summed over the kept tokens, over a fixed count per row: a micro-batch's loss is then its share of the
    # batch's (a mean over each micro-batch's own kept tokens would weigh them unlike one process does)
    flat = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return flat / targets.numel()


class _Call(nn.Module):
    """The model as one process calls it: a batch dict as keyword inputs, images as pixel_values."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        if isinstance(x, dict):
            return self.m(**x).logits
        return (self.m(pixel_values=x) if x.is_floating_point() else self.m(input_ids=x)).logits


def _run(name, opt, pipelined):
    model = MODELS[name]().eval()  # dropout off: both runs compute the same function
    optim = OPTIMS[opt]([p for p in model.parameters() if p.requires_grad])
    if not pipelined:
        return (
            [ca.train_step(_Call(model), optim, x, y, loss_fn) for x, y in _batches(name)],
            eq.numpy_params(model, remove_duplicate=False),
            "",
        )
    plan = ca.compose(ca.pipeline_parallel(microbatches=2), ca.parallel_mode([("pipeline", 2)]))
    applied = plan(model, optim)
    model, optim, _ = applied
    losses = [ca.train_step(model, optim, x, y, loss_fn) for x, y in _batches(name)]
    return losses, eq.numpy_params(model, remove_duplicate=False), plan.explain(applied=applied)


def _world(rank, world):
    jobs = [(n, o) for n in MODELS for o in OPTIMS]
    mine = {f"{n}/{o}": _run(n, o, True) for n, o in jobs}
    refs = {f"{n}/{o}": _run(n, o, False) for n, o in eq.mine(rank, world, jobs)}
    return mine, refs


@pytest.mark.dist
def test_encoders_and_lora_pipeline_equal_to_one_process():
    (r0, refs0), (r1, refs1) = run_world(_world, 2, timeout=900)
    start = {n: eq.numpy_params(MODELS[n](), remove_duplicate=False) for n in MODELS}
    bad = {}
    for case, (ref_losses, ref_params, _) in {**refs0, **refs1}.items():
        # a piece every stage holds is on both, equal to one process's
        gap, weight, same, held = eq.stage_gaps([r0[case][:2], r1[case][:2]], ref_losses, ref_params)
        moved = max(float(abs(ref_params[n] - p).max()) for n, p in start[case.split("/")[0]].items())
        if not same or gap > TOL or weight > TOL or not held <= set(ref_params) or moved < 1e-4:
            bad[case] = (gap, weight, same, moved)
        explain = r0[case][2]
        assert "each stage's blocks see the whole model's inputs" in explain, (case, explain)
    assert not bad, bad
    table, norm = "'deberta.encoder.rel_embeddings'", "'deberta.encoder.LayerNorm', "
    for name, held in {"deberta_rel": norm + table, "deberta_v3": norm + table, "deberta_c2p": table}.items():
        assert f"[{held}] held by every stage" in r0[f"{name}/sgd"][2], r0[f"{name}/sgd"][2]
    # every stage checked on both forms a batch can take, the config fed the unpadded one
    assert "probes of (2, 16): padded (its attention mask carried) and unpadded" in r0["deberta_v3/sgd"][2]
    # LoRA: the base weights did not move, the adapters did (equal to one process, checked above)
    lora = {**refs0, **refs1}["lora_llama/adamw"][1]
    base = start["lora_llama"]
    assert all((lora[n] == p).all() for n, p in base.items() if "lora_" not in n)


def test_two_tower_and_seq2seq_are_refused_with_the_true_reason():
    from transformers import CLIPConfig, CLIPModel, T5Config, T5ForConditionalGeneration

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    clip = CLIPModel(
        CLIPConfig(text_config={**tiny, "vocab_size": 64}, vision_config={**tiny, "image_size": 16, "patch_size": 8})
    )
    with pytest.raises(UncuttableModelError, match="two towers"):
        ca.pipeline_parallel().cuts(clip, 2)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    with pytest.raises(UncuttableModelError, match="encoder-decoder has two block stacks"):
        ca.pipeline_parallel().cuts(t5, 2)

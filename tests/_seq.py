"""Shared by the context-parallel and Ulysses tests: a plain user model calling
scaled_dot_product_attention, a tiny transformers Llama (defaults left on), and one training run
of a plan compared with one process on the same global batches."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset

SEQ, BATCH, STEPS = 64, 4, 3


class UserLM(nn.Module):
    """A user's model: learned absolute positions, fused attention, ``forward(tokens, position_ids=None)``."""

    def __init__(self, vocab=256, d=32, heads=4, layers=2, max_len=SEQ):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d),
                    "qkv": nn.Linear(d, 3 * d),
                    "o": nn.Linear(d, d),
                    "ln2": nn.LayerNorm(d),
                    "fc1": nn.Linear(d, 2 * d),
                    "fc2": nn.Linear(2 * d, d),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, position_ids=None):
        b, t = tokens.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=tokens.device)[None]
        x = self.tok(tokens) + self.pos(position_ids)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["o"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x))))
        return self.head(self.ln_f(x))


def user_lm(seed: int = 0, **kw) -> UserLM:
    torch.manual_seed(seed)
    return UserLM(**kw)


def llama(seed: int = 0, heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


def llama_mqa(seed: int = 0):
    """One key/value head: fewer than the sequence size, so Ulysses repeats them before its all-to-all."""
    return llama(seed, kv_heads=1)


MODELS = {"user": user_lm, "llama": llama, "llama_mqa": llama_mqa}


def seq_loss(out, targets):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class Padded(TextDataset):
    """Targets of the last quarter ignored (-100): under context 2 they all fall in rank 0's part."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        y = y.clone()
        y[3 * SEQ // 4 :] = -100
        return x, y


def loader(batch: int = BATCH, padded: bool = False) -> DataLoader:
    return DataLoader((Padded if padded else TextDataset)(SEQ, limit=4 * BATCH), batch_size=batch)


def make_optim(model, name: str):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def full_params(m) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in ca.runtime.optim.named_parameters(m).items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def reference(model_name: str, optim_name: str, steps: int = STEPS, padded: bool = False):
    """One process, no plan, the same global batches."""
    m = MODELS[model_name]()
    opt = make_optim(m, optim_name)
    losses = []
    for _, (x, y) in zip(range(steps), loader(padded=padded), strict=False):
        loss = seq_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return full_params(m), losses


def run(model_name: str, optim_name: str, *transforms, steps: int = STEPS, strategy=None, padded=False):
    """Apply the plan (or ATorch strategy list through load_strategy) and train ``steps`` steps."""
    m = MODELS[model_name]()
    opt = make_optim(m, optim_name)
    if strategy is not None:
        plan = ca.strategy.load(strategy)
    else:
        plan = ca.compose(*transforms)
    applied = plan(m, opt, loader(padded=padded))
    m, opt, data = applied
    loss_fn = ca.sequence_cross_entropy(m) if padded else seq_loss
    losses, shapes = [], []
    for _, (x, y) in zip(range(steps), data, strict=False):
        shapes.append(tuple(x.shape))
        losses.append(ca.train_step(m, opt, x, y, loss_fn))
    # numpy: tensors through the result queue would be shared-memory handles of a process that exits
    params = {k: v.numpy() for k, v in full_params(m).items()}
    return {"params": params, "losses": losses, "shapes": shapes, "explain": plan.explain(applied)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:5], sorted(b)[:5])
    return max((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max().item() for k in a)


def close(got: dict, ref) -> tuple[float, float]:
    params, losses = ref
    return max_diff(got["params"], params), max(abs(x - y) for x, y in zip(got["losses"], losses, strict=True))


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def measured_peak(plan_json: str, task) -> int:
    """This rank's peak of one training step of ``plan_json`` on ``task`` (an auto.workload.GPTTask),
    measured as the trial worker measures (MemTracker after two warm-up steps, the batch fetched
    before the tracker starts), the batch taken through the plan's loader (a split shards it)."""
    from composable_atorch.auto.worker import peak_bytes_of_step, prefetch, trial_step

    torch.manual_seed(0)
    model = task.model()
    optim = task.optimizer(model)
    data_loader = DataLoader(task.dataset(), batch_size=task.batch_size)
    model, optim, data_loader = ca.Plan.from_json(plan_json)(model, optim, data_loader)
    data = iter([next(iter(data_loader))] * 3)
    for _ in range(2):
        trial_step(model, optim, data, task.loss, "cpu")
    fetched = prefetch(optim, data, "cpu")

    def step(before_micro=None):
        trial_step(model, optim, iter(fetched), task.loss, "cpu", before_micro)

    return peak_bytes_of_step(step, model, optim, "cpu")[0]


def assert_equals_one_process(runs, ref, atol: float, shape: tuple | None = None) -> None:
    """Every rank's run (``runs``, one :func:`run` result each) ends at the one-process ``ref``
    (:func:`reference`): weights and every step's loss within ``atol``; with ``shape``, its first
    batch had that shape on every rank (``(BATCH, SEQ // 2)``: half of each sequence per rank)."""
    for rank, got in enumerate(runs):
        if shape is not None:
            assert got["shapes"][0] == shape, (rank, got["shapes"][0], shape)
        dp, dl = close(got, ref)
        assert dp < atol and dl < atol, (rank, dp, dl)

"""Launched by tests/test_faults.py and benchmarks/restarts.py: ddp training that loses a rank.

    train_restart.py --ckpt DIR --out DIR --steps N --save-every K [--kill RANK:STEP] [--stop RANK:STEP]

Resumes from the latest checkpoint in ``--ckpt``. In the first round only (torchrun's
``TORCHELASTIC_RESTART_COUNT`` 0), ``--kill R:S`` makes rank R SIGKILL itself after step S and
``--stop R:S`` makes it SIGSTOP itself (a hung rank). Rank 0 writes the final weights and
optimizer state to ``OUT/final.safetensors``; each rank appends its step losses to
``OUT/losses-rank{r}.jsonl``.
"""

import argparse
import json
import os
import signal

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import composable_atorch as ca
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss
from composable_atorch.state.save import latest_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--save-every", type=int, required=True)
parser.add_argument("--kill", default=None)
parser.add_argument("--stop", default=None)
args = parser.parse_args()


def fault(spec):
    return None if spec is None else tuple(int(v) for v in spec.split(":"))


torch.set_num_threads(1)
ca.init_distributed("gloo")  # the collective timeout comes from launch --timeout
rank = torch.distributed.get_rank()
first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2, dropout=0.1))
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = DataLoader(TextDataset(16, limit=48), batch_size=8, shuffle=True)
model, optim, loader = ca.ddp()(model, optim, loader)

step = 0
if latest_checkpoint(args.ckpt) is not None:
    step = ca.load_state(args.ckpt, model, optim, loader).step
log = open(os.path.join(args.out, f"losses-rank{rank}.jsonl"), "a")
epoch = loader.epoch
while step < args.steps:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        loss = lm_loss(model(x), y)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        step += 1
        log.write(
            json.dumps({"step": step, "loss": loss.item(), "round": os.environ.get("TORCHELASTIC_RESTART_COUNT")})
        )
        log.write("\n")
        log.flush()
        if step % args.save_every == 0:
            ca.save_state(args.ckpt, model, optim, loader, step=step)
        for spec, sig in ((fault(args.kill), signal.SIGKILL), (fault(args.stop), signal.SIGSTOP)):
            if first_round and spec == (rank, step):
                os.kill(os.getpid(), sig)
        if step >= args.steps:
            break
    epoch += 1
if rank == 0:
    state = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, (_p, st) in enumerate(optim.optimizer.state.items()):
        state.update({f"optim.{i}.{k}": v.clone().contiguous() for k, v in st.items() if torch.is_tensor(v)})
    save_file(state, os.path.join(args.out, "final.safetensors"))
torch.distributed.destroy_process_group()

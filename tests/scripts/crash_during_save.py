"""Launched by tests/state/test_checkpointing.py: save step 2, then die by SIGKILL in the middle of saving step 3.

    crash_during_save.py CKPT_DIR OUT_DIR KILL_POINT

KILL_POINT is where the second save is killed:
  ``data``    inside DCP, after its data file is written and while it is being fsynced;
  ``publish`` after every file is written, before the directory is renamed into place;
  ``pointer`` after the rename, before latest.json moves.
The weights and optimizer state at step 2 go to ``OUT_DIR/step2.safetensors`` (the reference).
"""

import os
import signal
import sys

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader

import composable_atorch as ca
import composable_atorch.state.files as checkpoint_files
import composable_atorch.state.save as checkpointing
from composable_atorch.data import TextDataset
from composable_atorch.models import GPT, GPTConfig
from composable_atorch.models.gpt import lm_loss

ckpt, out, kill_point = sys.argv[1:4]
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = DataLoader(TextDataset(16, limit=32), batch_size=4, shuffle=True)
model, optim, loader = ca.compose()(model, optim, loader)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


batches = iter(loader)
for step in (1, 2, 3):
    x, y = next(batches)
    optim.backward(lm_loss(model(x), y))
    optim.step()
    optim.zero_grad()
    if step == 2:
        ca.save_state(ckpt, model, optim, loader, step=2)
        model_sd, optim_sd = get_state_dict(
            model, [optim.optimizer], options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        ref = {f"model.{k}": v for k, v in model_sd.items()}
        ref.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "step2.safetensors"))

if kill_point == "data":
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:  # 1st: DCP's data file (this rank's JSON follows DCP's files)
            die()
        real_fsync(fd)

    os.fsync = fsync
elif kill_point == "publish":
    checkpointing.publish = lambda *args: die()
elif kill_point == "pointer":
    real_write = checkpoint_files.write_json

    def write_json(path, data):
        if path.name == checkpoint_files.LATEST:
            die()
        real_write(path, data)

    checkpoint_files.write_json = write_json
else:
    raise SystemExit(f"unknown kill point {kill_point!r}")
ca.save_state(ckpt, model, optim, loader, step=3)
raise SystemExit("the save was supposed to be killed")

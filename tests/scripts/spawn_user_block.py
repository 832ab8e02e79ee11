"""A user's script, as issue 30 ran it: ``Block`` is defined here, ranks start with
``torch.multiprocessing.spawn`` (so in each rank this script is ``__mp_main__``), and
semi-automatic ``auto_accelerate`` at world 2 checkpoints ``Block`` by the class object itself.

    python spawn_user_block.py OUT_DIR

Each rank trains 3 steps and writes ``rank<N>.json`` to OUT_DIR: the plan, the losses, a parameter
checksum (replicas must agree), and what loading a plan *file* naming ``__mp_main__:Block`` gave
(the allow-list must still refuse it: only objects handed over in code are trusted).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn

WORLD = 2


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin, self.act = nn.Linear(width, width), nn.Tanh()

    def forward(self, x):
        return x + self.act(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loss_func(batch, output):
    return nn.functional.mse_loss(output, batch[1])


def prepare_input(batch, device):
    return batch


def rank_main(rank, out_dir):
    from composable_atorch import strategy
    from composable_atorch.compat.atorch import auto_accelerate
    from composable_atorch.errors import UntrustedInputError

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = Net()
    status, result, best = auto_accelerate(
        model,
        torch.optim.SGD,
        Rows(),
        loss_func=loss_func,
        prepare_input=prepare_input,
        optim_args={"lr": 0.05},
        dataloader_args={"batch_size": 8},
        load_strategy=["parallel_mode", ("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", (Block,))],
    )
    losses, data = [], iter(result.dataloader)
    for _ in range(3):
        batch = result.prepare_input(next(data), "cpu")
        loss = result.loss_func(batch, result.model(batch[0]))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(loss.item())
    checksum = float(sum(p.detach().double().sum() for p in result.model.parameters()))
    # the same name from a file: another writer's text, not the user's code -> the allow-list decides
    plan_file = os.path.join(out_dir, f"foreign{rank}.json")
    text = best.to_json().replace("__main__:Block", "__mp_main__:Block")
    with open(plan_file, "w") as f:
        f.write(text)
    try:
        strategy.load(plan_file)
        from_file = "loaded"
    except UntrustedInputError as exc:
        from_file = f"UntrustedInputError: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "status": status,
                "module": Block.__module__,
                "plan": best.to_json(),
                "steps": list(best.names),
                "report": {k: list(v) for k, v in (getattr(result.optim, "report", None) or {}).items()},
                "losses": losses,
                "checksum": checksum,
                "from_file": from_file,
            },
            f,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    tmp.spawn(rank_main, args=(sys.argv[1],), nprocs=WORLD, join=True)

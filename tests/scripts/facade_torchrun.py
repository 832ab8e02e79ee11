"""Run under torchrun (2 processes): auto_accelerate in semi-automatic and fully automatic mode.

Each rank trains a few steps with what it got back and writes rank<N>.json into OUT_DIR:
status, the plan JSON, losses, and a checksum of its parameters (ranks must agree).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import composable_atorch as ca  # noqa: E402

import seed_task  # noqa: E402


def train(result, steps=12):
    model, optim, loader = result.model, result.optim, result.dataloader
    losses, data = [], iter(loader)
    for _ in range(steps):
        try:
            batch = next(data)
        except StopIteration:
            data = iter(loader)
            batch = next(data)
        batch = result.prepare_input(batch, "cpu")
        loss = result.loss_func(batch, model(**batch))
        if result.args.use_optim_backward:
            optim.backward(loss)
        else:
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def checksum(model):
    with torch.no_grad():
        return float(
            sum(
                p.full_tensor().double().sum() if hasattr(p, "full_tensor") else p.double().sum()
                for p in model.parameters()
            )
        )


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    common = dict(
        optim_func=torch.optim.AdamW,
        dataset=seed_task.DictText(),
        loss_func=seed_task.loss_func,
        model_input_format="unpack_dict",
        optim_args={"lr": 3e-3},
        dataloader_args={"batch_size": 8, "shuffle": True},
    )
    report = {}
    status, result, plan = ca.auto_accelerate(
        seed_task.build(),
        load_strategy=["parallel_mode", ("amp_native", {"dtype": torch.bfloat16})],
        save_strategy_to_file=os.path.join(out_dir, "semi.json"),
        **common,
    )
    report["semi"] = {
        "status": status,
        "plan": plan.to_json(),
        "losses": train(result),
        "checksum": checksum(result.model),
        "use_optim_backward": result.args.use_optim_backward,
    }
    keep = {"amp", "checkpoint", "ddp", "fsdp", "zero1", "zero2"}
    status, result, plan = ca.auto_accelerate(
        seed_task.build(),
        excluded=sorted(set(ca.registry()) - keep),
        n_trials=2,
        trial_timeout=90,
        save_strategy_to_file=os.path.join(out_dir, "auto.json"),
        **common,
    )
    report["auto"] = {
        "status": status,
        "plan": plan.to_json(),
        "losses": train(result),
        "checksum": checksum(result.model),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

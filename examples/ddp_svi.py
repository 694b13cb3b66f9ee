"""Data-parallel flat-seeking VI (F-VI: SharpnessAwareELBO + AutoNormal) on digits with torchrun.

    torchrun --nproc_per_node=2 examples/ddp_svi.py              # 2 processes on this machine (gloo on CPU)
    torchrun --nproc_per_node=4 examples/ddp_svi.py              # 4 GPUs: NCCL, one GPU per process
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 examples/ddp_svi.py

Every rank seeds Pyro alike (same network init, same guide draws), draws the same global minibatch of ``--batch``
examples per step from a generator seeded alike, and trains on its shard of it with ``num_data=N``; DDP averages the
parameter gradients and ``SharpnessAwareELBO(distributed=True)`` the SAM ascent direction, so the run equals one
process with the whole minibatch (see :mod:`pyro_flat.distributed`). Rank 0 evaluates the BMA at the end.
"""

from __future__ import annotations

import argparse
import os

import pyro
import torch
import torch.distributed as dist
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal

from pyro_flat.data import load_digits
from pyro_flat.distributed import ddp_elbo
from pyro_flat.infer import SharpnessAwareELBO
from pyro_flat.metrics import evaluate
from pyro_flat.nn import BayesianMLP, init_to_network


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=128, help="global minibatch, split evenly over the ranks")
    parser.add_argument("--rho", type=float, default=0.05)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must be divisible by the number of processes {world}")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        data = load_digits(device=device)
        pyro.set_rng_seed(0)  # the same on every rank
        model = BayesianMLP(64, data.num_classes, hidden=(256, 256)).to(device)
        guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-3)
        shard = args.batch // world
        guide(data.x_train[:shard], data.y_train[:shard], num_data=data.num_data)
        loss = ddp_elbo(model, guide, SharpnessAwareELBO(args.rho, distributed=True),
                        device_ids=[device.index] if cuda else None)
        optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
        batches = torch.Generator(device=device).manual_seed(1)  # the same global minibatches on every rank
        for _ in range(args.steps):
            idx = torch.randperm(data.num_data, generator=batches, device=device)[: args.batch]
            idx = idx[rank * shard : (rank + 1) * shard]
            optim.zero_grad()
            loss(data.x_train[idx], data.y_train[idx], num_data=data.num_data).backward()
            optim.step()
        if rank == 0:
            predictive = Predictive(model, guide=guide, num_samples=30, return_sites=["logits"])
            report = evaluate(predictive(data.x_test), data.y_test)
            print(f"{world} processes, {args.steps} steps: acc {report['acc']:.3f}  nll {report['nll']:.3f}  "
                  f"ece {report['ece']:.3f}")
        dist.barrier()  # rank 0 evaluated alone: wait for it before tearing the group down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Data-parallel SVI on 2 gloo ranks against 1 process with the same total batch: steps per second and equality.

MLP 64-256-256-10 on sklearn's digits, `AutoNormal`, Adam 1e-3, a total minibatch of ``--batch`` (default 256) per
step: one process takes it whole; with DDP (``pyro_flat.distributed.ddp_elbo``, gloo backend, one torch thread per
rank) each of the 2 ranks takes half, with ``num_data=N``. For ``Trace_ELBO``, ``SharpnessAwareELBO(0.05,
distributed=True)`` and ``KLBallELBO(0.01, distributed=True)``: the median time per step over ``--repeats`` blocks of
``--steps`` steps (float32), and the largest difference between the guide parameters of rank 0 and of the single
process, relative to the largest value of each parameter tensor, after ``--steps`` steps of a float64 run with the
same seed and minibatches (in float32, Adam's sign-like first steps turn rounding differences of near-zero gradients
into differences of a whole step, lr, which says nothing about the algorithm).

The machine has 2 cores shared with other jobs: 2 ranks use both cores, 1 process uses one; gloo's all-reduce goes
through shared memory/TCP. Read the ratio as "what DDP costs or gains here", not as a GPU scaling figure.

Run: ``python benchmarks/ddp.py [--repeats 5] [--steps 20]``; writes ``benchmarks/results/ddp.md``.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import pyro
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _report import write_markdown
from _timing import environment, medians_ms, time_block
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_flat.data import load_digits
from pyro_flat.distributed import ddp_elbo
from pyro_flat.infer import KLBallELBO, SharpnessAwareELBO
from pyro_flat.nn import BayesianMLP, init_to_network

OBJECTIVES = {
    "Trace_ELBO": lambda distributed: Trace_ELBO(),
    "SharpnessAwareELBO": lambda distributed: SharpnessAwareELBO(0.05, distributed=distributed),
    "KLBallELBO": lambda distributed: KLBallELBO(0.01, distributed=distributed),
}


def run(
    objective: str, rank: int, world_size: int, args: argparse.Namespace, dtype: torch.dtype, repeats: int
) -> tuple[list[float], dict]:
    """Seconds per step of each block and the guide parameters after the first block, on this rank's shard."""
    torch.set_num_threads(1)
    torch.set_default_dtype(dtype)
    data = load_digits(dtype=dtype)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = BayesianMLP(64, 10, (256, 256), packed=False)  # a site a tensor, as measured in results/ddp.md
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-3)
    shard = args.batch // world_size
    guide(data.x_train[:shard], data.y_train[:shard], num_data=data.num_data)
    elbo = OBJECTIVES[objective](world_size > 1)
    loss = ddp_elbo(model, guide, elbo) if world_size > 1 else elbo(model, guide)
    optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)  # the same minibatches on every rank and in the single process
    def step() -> None:
        idx = torch.randperm(data.num_data, generator=generator)[: args.batch]
        idx = idx[rank * shard : (rank + 1) * shard]
        optim.zero_grad()
        loss(data.x_train[idx], data.y_train[idx], num_data=data.num_data).backward()
        optim.step()

    times, params = [], {}
    for block in range(repeats):
        times.append(time_block(step, args.steps))
        if block == 0:
            params = {n: p.detach().clone() for n, p in guide.named_parameters()}
    return times, params


def _both(objective: str, rank: int, world_size: int, args: argparse.Namespace) -> tuple[list[float], dict]:
    """float32 timings and float64 parameters after one block."""
    times, _ = run(objective, rank, world_size, args, torch.float32, args.repeats)
    _, params = run(objective, rank, world_size, args, torch.float64, 1)
    return times, params


def _rank(rank: int, port: int, out_dir: str, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {objective: _both(objective, rank, 2, args) for objective in OBJECTIVES}
        if rank == 0:
            torch.save(results, Path(out_dir) / "ddp.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ddp.md")
    args = parser.parse_args(argv)
    single = {objective: _both(objective, 0, 1, args) for objective in OBJECTIVES}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(_free_port(), out_dir, args), nprocs=2, join=True)
        ddp = torch.load(Path(out_dir) / "ddp.pt", weights_only=True)
    lines = [
        "# Data-parallel SVI: 2 gloo ranks vs 1 process",
        "",
        f"MLP 64-256-256-10 on digits, AutoNormal, Adam 1e-3, total batch {args.batch} per step (2 x {args.batch // 2} "
        f"with DDP), float32, one torch thread per process; {args.repeats} blocks x {args.steps} steps, median. "
        f"{environment()}",
        "",
        "| objective | 1 process (ms / step) | DDP 2 ranks (ms / step) | speed-up (1 proc / DDP) | max relative param "
        f"difference after {args.steps} steps (float64) |",
        "|---|---|---|---|---|",
    ]
    for objective in OBJECTIVES:
        t1, p1 = single[objective]
        t2, p2 = ddp[objective]
        m1, m2 = medians_ms({"1": t1, "2": t2}).values()
        diff = max(float((p1[n] - p2[n]).abs().max() / p1[n].abs().max()) for n in p1)
        lines.append(f"| {objective} | {m1:.2f} | {m2:.2f} | {m1 / m2:.2f} | {diff:.1e} |")
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()

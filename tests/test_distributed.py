"""Data-parallel training with torch.distributed: 2 gloo processes with half the batch each reach the parameters of
one process with the whole batch, for Trace_ELBO, SharpnessAwareELBO, KLBallELBO and BayesianSAM; GlobalBatchNorm on 2
ranks normalises, differentiates and tracks statistics as BatchNorm does on the whole batch.

Tolerance: float64, 5 Adam / bSAM steps; the two runs do the same arithmetic except for the order of the sums over
the batch (per shard, then the mean of the two shards), so they agree to ~1e-15 relative per step; rtol 1e-9 leaves
room for Adam's normalisation without hiding a wrong perturbation (the negative control differs by > 1e-4).
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pyro
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pyro_flat.distributed import (
    GlobalBatchNorm,
    all_reduce_mean,
    check_same_random_state,
    convert_batchnorm,
    ddp_elbo,
)
from pyro_flat.infer import KLBallELBO, SharpnessAwareELBO
from pyro_flat.nn import BayesianMLP
from pyro_flat.optim import BayesianSAM

STEPS, NUM_DATA, BATCH = 5, 64, 16
OBJECTIVES = ("trace", "sharpness_aware", "sharpness_aware_local", "kl_ball", "kl_ball_local", "bsam")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 4, generator=generator, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _train_svi(objective: str, x: torch.Tensor, y: torch.Tensor, distributed: bool) -> dict[str, torch.Tensor]:
    """STEPS Adam steps on Pyro's ELBOModule (wrapped in DDP when ``distributed``); returns the guide parameters."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)  # the same seed on every rank: the same network init and the same guide draws
    model = BayesianMLP(4, 3, hidden=(8,))
    guide = AutoNormal(model, init_scale=0.1)
    guide(x, y, num_data=NUM_DATA)
    # `_local` variants: data-parallel, but the ascent uses each rank's own gradient (the negative control)
    all_reduce = distributed and not objective.endswith("_local")
    elbo = {
        "trace": lambda: Trace_ELBO(),
        "sharpness_aware": lambda: SharpnessAwareELBO(0.5, distributed=all_reduce),
        "kl_ball": lambda: KLBallELBO(0.5, distributed=all_reduce),
    }[objective.removesuffix("_local")]()
    loss_module = ddp_elbo(model, guide, elbo) if distributed else elbo(model, guide)
    optim = torch.optim.Adam(loss_module.parameters(), lr=0.05)
    for _ in range(STEPS):
        optim.zero_grad()
        loss_module(x, y, num_data=NUM_DATA).backward()
        optim.step()
    return {name: p.detach().clone() for name, p in guide.named_parameters()}


def _train_bsam(x: torch.Tensor, y: torch.Tensor, distributed: bool) -> dict[str, torch.Tensor]:
    """STEPS BayesianSAM steps on a plain torch network (DDP-wrapped when ``distributed``)."""
    torch.manual_seed(0)  # the same init and the same bSAM noise on every rank
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    module = DistributedDataParallel(net) if distributed else net
    optim = BayesianSAM(net.parameters(), lr=0.1, num_data=NUM_DATA, rho=0.05)
    for _ in range(STEPS):
        optim.step(lambda: F.cross_entropy(module(x), y).backward())  # mean over this rank's shard
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def _train(objective: str, x: torch.Tensor, y: torch.Tensor, distributed: bool) -> dict[str, torch.Tensor]:
    torch.set_default_dtype(torch.float64)
    if objective == "bsam":
        return _train_bsam(x, y, distributed)
    return _train_svi(objective, x, y, distributed)


def _batchnorm_pass(layer: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two training passes of ``layer`` on ``x`` (a loss ``sum(weights * y)`` backpropagated each time), then one in
    eval mode: outputs, input and parameter gradients, running statistics."""
    x = x.clone().requires_grad_()
    for _ in range(2):
        y = layer(x)
        (weights * y).sum().backward()
    layer.eval()
    return {"y": y.detach(), "x_grad": x.grad, "weight_grad": layer.weight.grad, "bias_grad": layer.bias.grad,
            "running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone(),
            "eval": layer(x).detach()}


def _batchnorm_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    layer = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        layer.weight.copy_(torch.rand(3, generator=generator, dtype=torch.float64) + 0.5)
        layer.bias.copy_(torch.randn(3, generator=generator, dtype=torch.float64))
    x = torch.randn(BATCH, 3, 4, 5, generator=generator, dtype=torch.float64) * 2 + 1
    return layer, x, torch.randn(BATCH, 3, 4, 5, generator=generator, dtype=torch.float64)


def _rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One gloo rank: its half of the batch, every objective; results saved for the parent process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        x, y = _data()
        shard = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        results = {objective: _train(objective, x[shard], y[shard], True) for objective in OBJECTIVES}
        layer, x_bn, weights = _batchnorm_case()
        half = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        results["global_batchnorm"] = _batchnorm_pass(convert_batchnorm(layer), x_bn[half], weights[half])
        results["local_batchnorm"] = _batchnorm_pass(_batchnorm_case()[0], x_bn[half], weights[half])
        reduced = all_reduce_mean([torch.full((2, 3), float(rank)), torch.full((4,), 2.0 * rank)])
        results["all_reduce_mean"] = {"a": reduced[0], "b": reduced[1]}
        torch.manual_seed(7)
        check_same_random_state()  # the same seed everywhere: no error
        torch.manual_seed(rank)
        try:
            check_same_random_state()
            results["seeds_differ_detected"] = False
        except ValueError as error:
            results["seeds_differ_detected"] = "random states differ" in str(error)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp")
    mp.spawn(_rank, args=(2, _free_port(), str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("objective", ["trace", "sharpness_aware", "kl_ball", "bsam"])
def test_two_ranks_with_half_the_batch_match_one_process_with_the_whole_batch(objective, two_rank_results):
    x, y = _data()
    single = _train(objective, x, y, distributed=False)
    for rank_result in two_rank_results:
        assert rank_result[objective].keys() == single.keys()
        for name, value in single.items():
            torch.testing.assert_close(rank_result[objective][name], value, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("objective", ["sharpness_aware", "kl_ball"])
def test_without_the_all_reduced_ascent_the_ranks_drift_apart(objective, two_rank_results):
    # the negative control: each rank perturbs along its own shard's gradient, so the result is not the
    # single-process one (and the test above could fail)
    x, y = _data()
    single = _train(objective, x, y, distributed=False)
    local = two_rank_results[0][f"{objective}_local"]
    assert max((local[n] - single[n]).abs().max() for n in single) > 1e-4


def test_global_batchnorm_on_two_ranks_is_batchnorm_on_the_whole_batch(two_rank_results):
    """Outputs and input gradients of each rank's half, the sum of the ranks' parameter gradients (what DDP
    averages, times 2) and the running statistics equal one BatchNorm2d on the whole batch (float64; the sums are
    taken in another order: rtol 1e-10); a plain BatchNorm on each half is far off (the negative control)."""
    layer, x, weights = _batchnorm_case()
    whole = _batchnorm_pass(layer, x, weights)
    ranks = [result["global_batchnorm"] for result in two_rank_results]
    for key in ("y", "x_grad", "eval"):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), whole[key], rtol=1e-10, atol=1e-12, msg=key)
    for key in ("weight_grad", "bias_grad"):
        torch.testing.assert_close(sum(r[key] for r in ranks), whole[key], rtol=1e-10, atol=1e-12, msg=key)
    for r in ranks:
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(r[key], whole[key], rtol=1e-10, atol=1e-12, msg=key)
    local = torch.cat([result["local_batchnorm"]["y"] for result in two_rank_results])
    assert (local - whole["y"]).abs().max() > 1e-2


def test_convert_batchnorm_keeps_parameters_statistics_and_mode():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.ReLU(), nn.BatchNorm2d(4)))
    net[1].running_mean.fill_(0.5)
    net.eval()
    weight, reference = net[1].weight, copy.deepcopy(net)
    converted = convert_batchnorm(net)
    assert isinstance(converted[1], GlobalBatchNorm) and isinstance(converted[2][1], GlobalBatchNorm)
    assert converted[1].weight is weight and float(converted[1].running_mean[0]) == 0.5 and not converted[1].training
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(converted(x), reference(x))  # no process group: plain BatchNorm
    converted.train(), reference.train()
    torch.testing.assert_close(converted(x), reference(x))


def test_all_reduce_mean_averages_over_the_ranks(two_rank_results):
    for rank_result in two_rank_results:  # ranks 0 and 1 hold 0 and 1 (a), 0 and 2 (b): means 0.5 and 1
        torch.testing.assert_close(rank_result["all_reduce_mean"]["a"], torch.full((2, 3), 0.5))
        torch.testing.assert_close(rank_result["all_reduce_mean"]["b"], torch.full((4,), 1.0))


def test_ranks_seeded_differently_are_detected(two_rank_results):
    assert all(result["seeds_differ_detected"] for result in two_rank_results)


def test_distributed_option_needs_a_process_group():
    x, y = _data()
    model = BayesianMLP(4, 3, hidden=(8,))
    guide = AutoNormal(model)
    for elbo in (SharpnessAwareELBO(0.1, distributed=True), KLBallELBO(0.1, distributed=True)):
        with pytest.raises(ValueError, match="init_process_group"):
            elbo.differentiable_loss(model, guide, x, y, num_data=NUM_DATA)
    with pytest.raises(ValueError, match="init_process_group"):
        ddp_elbo(model, guide, Trace_ELBO())
    with pytest.raises(ValueError, match="`distributed` must be a bool"):
        SharpnessAwareELBO(0.1, distributed="yes")
    with pytest.raises(ValueError, match="`distributed` must be a bool"):
        KLBallELBO(0.1, distributed=1)


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_torchrun_example_trains_on_two_gloo_ranks():
    # the README's torchrun recipe, run as a user would (2 processes on CPU: gloo)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port()),
         str(ROOT / "examples" / "ddp_svi.py"), "--steps", "20"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    match = re.search(r"2 processes, 20 steps: acc ([0-9.]+)", result.stdout)
    assert match and float(match.group(1)) > 0.5  # 20 steps of F-VI on digits: well above chance (0.1)


@pytest.mark.slow
def test_the_ddp_benchmark_runs_and_reports_equal_parameters(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # importable by name: its ranks are spawned processes
    module = importlib.import_module("ddp")
    text = module.main(["--repeats", "1", "--steps", "2", "--batch", "64", "--out", str(tmp_path / "ddp.md")])
    rows = [line for line in text.splitlines() if line.startswith(("| Trace", "| Sharp", "| KLBall"))]
    assert len(rows) == 3
    for row in rows:  # float64 parameters of the 2-rank run equal the single-process ones
        assert float(row.rstrip(" |").rsplit("|", 1)[1]) < 1e-8

"""Paper scale in the harness: the ResNets and the CIFAR folder format, the DataLoader path for every family of
methods, bf16 autocast (the SAM ascent and the Fisher algebra stay float32), channels-last, and data-parallel runs
of every SVI method under torchrun (2 gloo ranks equal 1 rank)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_flat.bench import RunConfig
from pyro_flat.bench.problem import Problem
from pyro_flat.bench.registry import load_data
from pyro_flat.bench.runner import run_one
from pyro_flat.data import VisionData, write_synthetic_cifar
from pyro_flat.infer import AutoLowRankPlusDiagonalNormal, KLBallELBO, SharpnessAwareELBO
from pyro_flat.infer.elbo import kl_ball as kl_ball_module
from pyro_flat.infer.util import latent_sites
from pyro_flat.nn import init_to_network, unpacked_sites
from pyro_flat.transforms import sharpness_aware_model as sharpness_aware_module

pytest.importorskip("torchvision")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar(root, "cifar10", num_train=40, num_test=20)
    return root


def _config(cifar, **changes):
    base = dict(model="resnet18", width=2, data_root=str(cifar), num_epochs=1, batch_size=20, num_bma_samples=2,
                lambda_max_draws=1, lambda_max_points=8, lambda_max_iters=2)
    return RunConfig(**(base | changes))


@pytest.mark.parametrize("model, arch", [("resnet18", {"width": 2}), ("preresnet", {"depth": 8, "width": 2}),
                                         ("wrn", {"depth": 10, "width": 1})])
@pytest.mark.parametrize("latent", ["all", "norm_and_head", "head"])
def test_the_resnets_are_harness_models_with_a_choice_of_latent_weights(cifar, model, arch, latent):
    config = _config(cifar, model=model, latent=latent, norm="group", **arch)
    data = load_data("cifar10", config)
    assert isinstance(data, VisionData) and data.input_shape == (3, 32, 32)
    net = Problem(data.to(dtype=torch.float32), config).build_model()
    from pyro import poutine

    trace = poutine.trace(net).get_trace(data.x_train[:4].float(), data.y_train[:4])
    assert {k for k in latent_sites(trace) if k != "obs"} == {"net.weights"}  # the harness packs the latent weights
    latents = unpacked_sites(net)["net.weights"]  # the weight tensors in the packed site: {name: shape}
    learned = {name for name, _ in net.named_parameters()}
    assert not any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    if latent == "all":
        assert not learned
    else:  # the other weights are learned point estimates (trained by SVI with the latents)
        assert learned and all(name.startswith("net.") for name in learned)
        heads = {k for k, shape in latents.items() if ".weight" in k and shape[0] == 10 and len(shape) == 2}
        assert len(heads) == 1
        if latent == "head":
            assert len(latents) == 2  # weight and bias of the head


@pytest.mark.parametrize("method", ["vi", "f_swag", "sgld"])
def test_augmented_minibatches_from_a_dataloader_reach_every_family(cifar, method):
    """SVI (vi), a closure optimizer with a SWAG collector (f_swag) and a kernel (sgld) trained on augmented CIFAR
    minibatches passed with num_data (2 epochs of 2 steps)."""
    options = {"f_swag": {"swa_start": 0}}
    record = run_one(method, "cifar10", 0, _config(cifar, num_epochs=2, options=options))
    assert 0 <= record.metrics["acc"] <= 1 and record.test_probs.shape == (20, 10)
    assert [e["step"] for e in record.entries] == [2, 4]  # 40 images, batch 20: 2 steps per epoch


def test_kernels_refuse_networks_with_learned_weights(cifar):
    with pytest.raises(ValueError, match="learned \\(non-latent\\) weights, which an MCMC kernel does not train"):
        run_one("sgld", "cifar10", 0, _config(cifar, latent="head"))


def test_loader_batches_are_what_the_model_sees(cifar, monkeypatch):
    config = _config(cifar)
    data = load_data("cifar10", config).to(dtype=torch.float32)
    problem = Problem(data, config, seed=3)
    stream = problem.stream(0)
    (x, y), kwargs = next(stream)
    assert kwargs == {"num_data": 40} and x.shape == (20, 3, 32, 32) and x.dtype == torch.float32
    reference = data.train_batches(20, seed=stream.seed)
    x0, y0 = next(iter(reference))
    assert torch.equal(x, x0) and torch.equal(y, y0)
    assert stream.state_dict() == {"epoch": 0, "batch": 1}
    next(stream), next(stream)  # past the end of epoch 0: epoch 1 starts
    assert stream.state_dict() == {"epoch": 1, "batch": 1}


def test_channels_last_gives_the_same_predictions(cifar):
    config = _config(cifar, dtype="float64")
    data = load_data("cifar10", config)
    seen = []
    models = {}
    for channels_last in (False, True):
        torch.manual_seed(0)
        model = Problem(data, config.replace(channels_last=channels_last)).build_model()
        model.net.conv1.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
        models[channels_last] = model
    x = data.x_train[:6].contiguous(memory_format=torch.channels_last)
    from pyro import poutine

    trace = poutine.trace(models[False]).get_trace(data.x_train[:6])
    values = {k: v for k, v in latent_sites(trace).items() if k != "obs"}
    outputs = [poutine.condition(models[c], data=values)(x if c else data.x_train[:6]) for c in (False, True)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)
    assert seen[-1] is True and seen[0] is False


def _record(monkeypatch, module, name, calls):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((name, args, kwargs, out))
        return out

    monkeypatch.setattr(module, name, wrapper)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


@pytest.mark.skipif(not torch.amp.is_autocast_available("cpu"), reason="no bf16 autocast on this CPU build")
def test_bf16_autocast_keeps_the_sam_ascent_and_the_fisher_algebra_in_float32(cifar, monkeypatch):
    config = _config(cifar, precision="bf16")
    data = load_data("cifar10", config).to(dtype=torch.float32)
    model = Problem(data, config).build_model()
    assert model.autocast is torch.bfloat16
    network_dtypes = []
    model.net.fc.register_forward_hook(lambda _m, _a, out: network_dtypes.append(out.dtype))
    x, y = data.x_train[:8], data.y_train[:8]
    calls = []
    _record(monkeypatch, sharpness_aware_module, "sam_perturbation", calls)
    _record(monkeypatch, kl_ball_module, "low_rank_gaussian_inverse_fisher_product", calls)
    _record(monkeypatch, kl_ball_module, "kl_ball_step", calls)

    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-2)
    loss = SharpnessAwareELBO(0.05).differentiable_loss(model, guide, x, y, num_data=40)
    low_rank = AutoLowRankPlusDiagonalNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-2, rank=2)
    kl_loss = KLBallELBO(0.1).differentiable_loss(model, low_rank, x, y, num_data=40)
    assert torch.isfinite(loss) and torch.isfinite(kl_loss)
    assert torch.bfloat16 in network_dtypes  # the network did run in bf16 ...
    assert {name for name, *_ in calls} == {"sam_perturbation", "low_rank_gaussian_inverse_fisher_product",
                                            "kl_ball_step"}
    for name, args, kwargs, out in calls:  # ... and every input and output of the algebra is float32
        assert {t.dtype for t in _tensors((args, list(kwargs.values()), out))} == {torch.float32}, name
    # the ascent is the float32 evaluation of rho g / ||g|| (a bf16 one would be off by ~1e-2)
    _, (grads, rho), _, perturbation = next(c for c in calls if c[0] == "sam_perturbation")
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads))
    for g, e in zip(grads, perturbation, strict=True):
        torch.testing.assert_close(e.double(), rho * g.double() / norm, rtol=1e-5, atol=1e-12)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def svi_methods() -> list[str]:
    """Every registered method but those of ``bench/sgmcmc.py`` (whose kernels do not all-reduce): a new method is
    run data-parallel here without being listed."""
    from pyro_flat.bench import METHODS, methods  # noqa: F401  (importing the method modules registers them)

    return [name for name, spec in METHODS.items() if spec.fit.__module__ != "pyro_flat.bench.sgmcmc"]


def _two_ranks_and_one(args: list[str], tmp_path: Path) -> tuple[dict, dict]:
    """The metrics of every method of the harness run ``python args`` under torchrun on 2 gloo ranks and on 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = {}
    for ranks in (2, 1):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_port",
                   str(_free_port()), *args, "--out", str(tmp_path / str(ranks))]
        runs[ranks] = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for run in runs.values():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
    two, one = ({r["method"]: r["metrics"] for r in json.loads((tmp_path / str(k) / "results.json").read_text())
                 ["records"]} for k in (2, 1))
    return two, one


@pytest.mark.slow
def test_every_svi_method_runs_data_parallel_under_torchrun(tmp_path):
    svi = svi_methods()
    assert {"map", "vi", "sa_bma", "bsam", "hwa", "mc_dropout"} <= set(svi) and not {"sgld", "emcmc"} & set(svi)
    args = ["-m", "pyro_flat", "bench", "--datasets", "digits", "--shots", "16", "--methods", *svi, "--epochs",
            "2", "--batch-size", "64", "--hidden", "8", "--dtype", "float64", "--bma-samples", "2",
            "--lambda-max-draws", "1", "--lambda-max-points", "16", "--lambda-max-iters", "2", "--no-progress",
            "--no-figures"]
    args += [f"--set={m}.swa_start=0" for m in ("swa", "swag", "swag_diag", "f_swa", "f_swag", "f_swag_diag", "hwa",
                                               "hwa_total", "hwa_scales", "vi_cyclical")]
    two, one = _two_ranks_and_one(args, tmp_path)
    assert set(two) == set(svi)
    # 2 ranks with half of each global batch (float64) reach the single rank's posterior: the same metrics up to the
    # order of the sums. MC-Dropout draws its masks per rank (each rank its own shard's), so it is a different
    # (equally valid) minibatch estimate: only checked to have run.
    for method in set(svi) - {"mc_dropout", "f_mc_dropout"}:
        for key, value in one[method].items():
            assert two[method][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (method, key)


BATCHNORM_METHODS = ("map", "vi", "f_vi", "sa_bma_diag", "bsam", "swag")
"""SVI, a flat objective, the KL ball, a closure optimizer and SWAG (BatchNorm refreshed per draw)."""


@pytest.mark.slow
def test_two_gloo_ranks_with_batchnorm_equal_one_rank_on_a_resnet(cifar, tmp_path):
    """Each rank used to normalise by its own half batch (here lambda_max 8 % and NLL 1e-4 off); GlobalBatchNorm
    all-reduces the batch statistics, so 2 ranks equal 1 rank with BatchNorm as with GroupNorm (float64, relative
    1e-6: the sums are taken in another order; measured 1e-14)."""
    args = ["-m", "pyro_flat", "bench", "--datasets", "cifar10", "--data-root", str(cifar), "--model", "preresnet",
            "--depth", "8", "--width", "2", "--norm", "batch", "--methods", *BATCHNORM_METHODS, "--epochs", "2",
            "--batch-size", "20", "--dtype", "float64", "--bma-samples", "2", "--lambda-max-draws", "1",
            "--lambda-max-points", "8", "--lambda-max-iters", "2", "--set=swag.swa_start=0", "--no-progress",
            "--no-figures"]
    two, one = _two_ranks_and_one(args, tmp_path)
    assert set(two) == set(one) == set(BATCHNORM_METHODS)
    for method in BATCHNORM_METHODS:
        for key, value in one[method].items():
            assert two[method][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (method, key)

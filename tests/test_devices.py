"""Device-agnostic checks of every public objective, kernel, optimizer, guide helper and streaming accumulator.

* Host synchronisations per step, counted on the CPU by :class:`pyro_flat.testing.HostSyncCounter`: they must not
  grow with the number of steps, and pyro_flat adds none beyond its Pyro/torch baseline (Pyro's ``SVI.step`` and
  ``Trace_ELBO`` read the loss as Python floats: that is Pyro's choice and the baseline).
* dtype walk: a float32 and a float64 model, each under the *other* default dtype (so a tensor made without
  ``dtype=`` shows), keep their dtype in guide parameters, samples, kernel states and optimizer states, and no
  operation mixes two floating dtypes.
* factory walk: no tensor made by pyro_flat's code on the default device, from construction on (making a network
  Bayesian, the guide's first call, the kernel's set-up) through the steps, collectors and metrics.
* on a device: every objective (through ``TensorSVI``), kernel, closure optimizer, collector and posterior guide
  built and stepped where the model lives, with no host synchronisation after its set-up (the ``no_host_sync``
  fixture). On ``meta``, the CPU twin run in CI: a tensor left on the CPU fails the first operation that meets it, and
  :class:`~pyro_flat.testing.HostSyncCounter` sees the reads and copies CUDA would make. On CUDA (skipped without a
  GPU), the same tests under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from functools import partial

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_flat import sharpness_aware
from pyro_flat.infer import (
    HWA,
    SGHMC,
    SGLD,
    AutoLowRankPlusDiagonalNormal,
    EntropyMCMC,
    EntropySGD,
    EntropySGLD,
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    JitSharpnessAwareMeanFieldELBO,
    KLBallELBO,
    SharpnessAwareELBO,
    SharpnessAwareMeanFieldELBO,
    SWAGCollector,
    TensorSVI,
    TensorTrace_ELBO,
    TensorTraceMeanField_ELBO,
    bma_predict,
    guide_draws,
    predict_logits,
)
from pyro_flat.infer.mcmc import CyclicalStepSize, DrawHook
from pyro_flat.metrics import StreamingBMA
from pyro_flat.nn import (
    BayesianClassifier,
    bayesian_transfer,
    init_to_network,
    latent_init_values,
    make_bayesian,
    pack_latents,
    resnet18,
)
from pyro_flat.optim import SAM, BayesianSAM
from pyro_flat.testing import HostSyncCounter

B = 16  # minibatch size


def _data(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=generator, dtype=dtype).to(device)
    y = torch.randint(0, 3, (64,), generator=generator).to(device)
    return x, y


def _model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> BayesianClassifier:
    """``BayesianMLP(5, 3, hidden=(8,), packed=False)`` made Bayesian where it lives: the torch network is moved to
    ``device`` and ``dtype`` first, as in ``make_bayesian(net.cuda())``, so what ``make_bayesian`` adds must follow it.
    One site per weight tensor (the ResNet below has the packed default)."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).to(device=device, dtype=dtype)
    return BayesianClassifier(make_bayesian(net, packed=False), 3)


# ---------------------------------------------------------------------------------------------------------------------
# the detector itself


def test_host_sync_counter_detects_scalar_reads_host_copies_and_data_dependent_shapes():
    x = torch.randn(4, dtype=torch.float64)
    meta = torch.empty(3, device="meta")
    with HostSyncCounter() as syncs:
        x.sum().item()
        float(x.sum())
        int(x.argmax())
        bool((x > 0).any())
        if (x > 0).all():
            pass
        _ = f"{x.sum():.3f}"
        x.tolist()
        x.cpu()
        x.numpy()
        x.to("cpu")
        with pytest.raises(NotImplementedError):  # counted before torch refuses: a meta tensor has no data
            meta.to(torch.device("cpu"))
        x[x > 0]
        x.nonzero()
    kinds = [s.kind for s in syncs.syncs]
    assert kinds.count("scalar read") == 6, syncs.report()
    assert {"host copy (.tolist)", "host copy (.cpu)", "host copy (.numpy)", "host copy (.to)"} <= set(kinds)
    assert kinds.count("host copy (.to)") == 2
    assert "data-dependent shape (boolean-mask index)" in kinds and "data-dependent shape (nonzero)" in kinds
    assert syncs.count == 13
    assert "test_devices.py" in syncs.syncs[0].where
    assert "13 host synchronisation(s)" in syncs.report()


def test_host_sync_counter_ignores_device_side_work_and_same_device_moves():
    x = torch.randn(4, 3, dtype=torch.float64)
    with HostSyncCounter() as syncs:
        y = torch.where(torch.isfinite(x).all(), x, torch.zeros_like(x)).to(device=x.device, dtype=torch.float32)
        y.to(x.device)
        torch.randn(3, device=x.device).mul_(2)
    assert syncs.count == 0, syncs.report()
    with syncs:  # re-entered: appends
        x.sum().item()
    assert syncs.count == 1
    syncs.reset()
    assert syncs.count == 0
    with pytest.raises(ValueError, match="HostSyncCounter: `depth` must be an int >= 0"):
        HostSyncCounter(depth=-1)


def test_host_sync_counter_sees_solver_status_reads_and_host_to_device_copies():
    # CUDA's solvers hand their status to the host (torch's error checks, MAGMA's batched solves); the *_ex forms and
    # triangular solves keep it on the device. On meta, a copy from the host is seen as on an accelerator
    a = torch.randn(4, 4, dtype=torch.float64)
    a = a @ a.T + torch.eye(4, dtype=torch.float64)
    b = torch.randn(4, 2, dtype=torch.float64)
    tril = torch.linalg.cholesky_ex(a).L
    with HostSyncCounter() as syncs:
        torch.linalg.cholesky(a)
        torch.linalg.cholesky_ex(a, check_errors=True)
        torch.linalg.inv(a)
        torch.linalg.solve(a, b)
        torch.linalg.eigh(a)
        torch.cholesky_inverse(tril)
        torch.cholesky_solve(b.expand(3, 4, 2), tril)
    kinds = [s.kind for s in syncs.syncs]
    assert kinds.count("solver status read (linalg error check)") == 3 and len(kinds) == 7, syncs.report()
    meta = torch.empty(4, 2, device="meta")
    with HostSyncCounter() as syncs:  # none of these reads or copies to the host
        torch.linalg.cholesky_ex(a)
        torch.linalg.inv_ex(a)
        torch.linalg.solve_triangular(tril, b, upper=False)
        torch.cholesky_solve(b, tril)  # one matrix: cuSOLVER, status on the device
        meta + meta
    assert syncs.count == 0, syncs.report()
    with HostSyncCounter() as syncs:
        b.to("meta")
        meta.copy_(b)
        meta[torch.tensor([0, 1])]
    assert [s.kind for s in syncs.syncs] == [
        "host-to-device copy (_to_copy)", "host-to-device copy (copy_)", "host-to-device copy (index)"
    ], syncs.report()


def _per_step(step: Callable[[], object], counts: tuple[int, ...] = (2, 6)) -> tuple[list[float], str]:
    """Syncs per step of ``step`` over runs of each length in ``counts`` (after one warm-up call)."""
    step()
    rates, report = [], ""
    for n in counts:
        with HostSyncCounter() as syncs:
            for _ in range(n):
                step()
        rates.append(syncs.count / n)
        report = syncs.report()
    return rates, report


# ---------------------------------------------------------------------------------------------------------------------
# objectives through Pyro's SVI: no sync beyond the Pyro baseline, none growing with the steps


def _resnet(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> BayesianClassifier:
    """ResNet-18 (width 4) with its weights packed in one site (the default, as the harness builds it), made Bayesian
    where it lives (as :func:`_model`)."""
    torch.manual_seed(0)
    net = resnet18(3, width=4).to(device=device, dtype=dtype)
    return BayesianClassifier(make_bayesian(net), 3)


def _images(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 8, 8, generator=generator, dtype=dtype).to(device)
    return x, torch.randint(0, 3, (32,), generator=generator).to(device)


NETWORKS = {"mlp": (_model, _data), "resnet-packed": (_resnet, _images)}


def _svi_step(loss: object, guide_class: type, transform: Callable | None = None, *, network: str = "mlp",
              svi_class: type | tuple[type, ...] = SVI, device: torch.device | str = "cpu",
              model: BayesianClassifier | None = None) -> Callable[[], object]:
    """An SVI step (on ``network``'s model, or ``model`` built beforehand); with a tuple of SVI classes, one step of
    each on the same model, guide and objective."""
    pyro.clear_param_store()
    make_model, make_data = NETWORKS[network]
    x, y = make_data(device)
    model = make_model(device) if model is None else model
    fitted = model if transform is None else transform(model)
    guide = guide_class(fitted, rank=2) if guide_class is AutoLowRankPlusDiagonalNormal else guide_class(fitted)
    optim = pyro.optim.Adam({"lr": 1e-2})
    classes = svi_class if isinstance(svi_class, tuple) else (svi_class,)
    steps = [partial(cls(fitted, guide, optim, loss).step, x, y, subsample_size=B) for cls in classes]
    return tuple(steps) if isinstance(svi_class, tuple) else steps[0]


UNCOMPILED = {"jit_options": {"backend": None}}  # the captured graph run as is: the compiled path, minus the compiler
OBJECTIVES = {
    # name: (objective, guide class, model transform)
    "TensorTrace_ELBO": (TensorTrace_ELBO, AutoNormal, None),
    "TensorTraceMeanField_ELBO": (TensorTraceMeanField_ELBO, AutoNormal, None),
    "TensorTrace_ELBO-AutoDelta": (TensorTrace_ELBO, AutoDelta, None),
    "SharpnessAwareELBO": (lambda: SharpnessAwareELBO(0.05), AutoNormal, None),
    "SharpnessAwareELBO-AutoDelta": (lambda: SharpnessAwareELBO(0.05), AutoDelta, None),
    "SharpnessAwareELBO-adaptive": (lambda: SharpnessAwareELBO(0.05, adaptive=True), AutoNormal, None),
    "SharpnessAwareMeanFieldELBO": (lambda: SharpnessAwareMeanFieldELBO(0.05), AutoNormal, None),
    "KLBallELBO-fisher": (lambda: KLBallELBO(0.1), AutoNormal, None),
    "KLBallELBO-score": (lambda: KLBallELBO(0.1, direction="normalized_score"), AutoNormal, None),
    "KLBallELBO-lowrank": (lambda: KLBallELBO(0.1), AutoLowRankPlusDiagonalNormal, None),
    "sharpness_aware-transform": (TensorTrace_ELBO, AutoNormal, lambda m: sharpness_aware(m, 0.05)),
    "JitSharpnessAwareELBO": (lambda: JitSharpnessAwareELBO(0.05, **UNCOMPILED), AutoNormal, None),
    "JitSharpnessAwareMeanFieldELBO": (lambda: JitSharpnessAwareMeanFieldELBO(0.05, **UNCOMPILED), AutoNormal, None),
    "JitKLBallELBO": (lambda: JitKLBallELBO(0.1, **UNCOMPILED), AutoNormal, None),
}
CAPTURED = {"JitSharpnessAwareELBO", "JitSharpnessAwareMeanFieldELBO", "JitKLBallELBO"}


@pytest.mark.parametrize(("name", "network"), [
    (name, network) for name in OBJECTIVES for network in NETWORKS
    # the compiled objectives capture a ResNet step in tens of seconds on a CPU: one of them on the ResNet
    if network == "mlp" or name not in CAPTURED or name == "JitSharpnessAwareELBO"
])
def test_objective_step_makes_no_host_read(name, network):
    # TensorSVI: none at all; SVI.step: one, the float it hands back. Validation checks are host reads by design
    pyro.enable_validation(False)
    make, guide_class, transform = OBJECTIVES[name]
    tensor_step, svi_step = _svi_step(make(), guide_class, transform, network=network, svi_class=(TensorSVI, SVI))
    for _ in range(3 if name in CAPTURED else 1):  # the compiled ones: eager, captured, then the graph runs
        tensor_step()
    rates, report = _per_step(tensor_step, (3,))
    assert rates == [0.0], f"{name} on {network}:\n{report}"
    rates, report = _per_step(svi_step, (3,))  # the same objective, model and guide (and capture)
    assert rates == [1.0], f"{name} on {network}:\n{report}"


def test_pyros_trace_elbo_reads_every_site_and_the_tensor_one_none():
    # the baseline the objectives replace: Trace_ELBO reads each site's log-density on the host
    pyro.enable_validation(False)
    rates, _ = _per_step(_svi_step(Trace_ELBO(), AutoNormal), (2,))
    assert rates[0] >= 2 * 4 + 1, rates  # 4 weight tensors: model and guide sites, the likelihood
    rates, report = _per_step(_svi_step(TensorTrace_ELBO(), AutoNormal, svi_class=TensorSVI), (2,))
    assert rates == [0.0], report


# ---------------------------------------------------------------------------------------------------------------------
# kernels: no sync per step; the divergence record is read every `divergence_check_every` steps only


KERNELS = {
    "SGLD": lambda m, **kw: SGLD(m, step_size=1e-4, init_strategy=init_to_network(m), **kw),
    "cSGLD": lambda m, **kw: SGLD(
        m, step_size=CyclicalStepSize(1e-4, 4, exploration_fraction=0.5), init_strategy=init_to_network(m), **kw
    ),
    "SGHMC": lambda m, **kw: SGHMC(m, step_size=1e-4, init_strategy=init_to_network(m), **kw),
    "EntropyMCMC": lambda m, **kw: EntropyMCMC(m, eta=0.1, step_size=1e-4, init_strategy=init_to_network(m), **kw),
    "EntropySGD": lambda m, **kw: EntropySGD(
        m, eta=0.1, step_size=1e-4, num_inner_steps=3, init_strategy=init_to_network(m), **kw
    ),
    "EntropySGLD": lambda m, **kw: EntropySGLD(
        m, eta=0.1, step_size=1e-4, num_inner_steps=3, init_strategy=init_to_network(m), **kw
    ),
}


def _kernel_chain(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64, *,
                  network: str = "mlp", model: BayesianClassifier | None = None, **kwargs: object):
    make_model, make_data = NETWORKS[network]
    x, y = make_data(device, dtype)
    model = make_model(device, dtype) if model is None else model
    kernel = KERNELS[name](model, **kwargs)
    kernel.setup(0, x, y, subsample_size=B)
    state = {"params": kernel.initial_params}

    def step() -> dict[str, torch.Tensor]:
        state["params"] = kernel.sample(state["params"])
        return state["params"]

    return kernel, step


@pytest.mark.parametrize("network", list(NETWORKS))
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_sample_makes_no_host_sync(name, network):
    pyro.enable_validation(False)
    _, step = _kernel_chain(name, network=network, divergence_check_every=10_000)
    rates, report = _per_step(step, (2,) if network == "mlp" else (1,))
    assert rates == [0.0], f"{name} on {network}:\n{report}"


def test_divergence_record_is_read_only_every_check_every_steps():
    pyro.enable_validation(False)
    kernel, step = _kernel_chain("SGLD", divergence_check_every=4)
    step()  # step 0 -> 1
    with HostSyncCounter() as syncs:
        step()  # 1 -> 2: no check
        step()  # 2 -> 3: no check
    assert syncs.count == 0, syncs.report()
    with HostSyncCounter() as syncs:
        for _ in range(4):  # 3 -> 7: one check (at 4)
            step()
    per_check = syncs.count
    assert per_check == 1 and "check_divergence" in syncs.syncs[0].where, syncs.report()  # one read per check
    with HostSyncCounter() as syncs:
        for _ in range(12):  # 7 -> 19: three checks (8, 12, 16)
            step()
    assert syncs.count == 3 * per_check, syncs.report()


# ---------------------------------------------------------------------------------------------------------------------
# optimizers


def _optimizer_step(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], network: str = "least-squares"
                    ) -> Callable[[], object]:
    """One step of ``make(params)`` on a plain-torch loss (itself free of host syncs, so the count is the optimizer's
    own): least squares, or the cross-entropy of a torch ResNet-18 (width 4, BatchNorm) on a minibatch."""
    generator = torch.Generator().manual_seed(0)
    if network == "resnet":
        torch.manual_seed(0)
        net = resnet18(3, width=4)
        x, y = _images()
        params = list(net.parameters())

        def loss_fn() -> torch.Tensor:
            return torch.nn.functional.cross_entropy(net(x[:B]), y[:B])
    else:
        a, b = torch.randn(32, 6, generator=generator), torch.randn(32, generator=generator)
        params = [torch.zeros(6, requires_grad=True), torch.zeros((), requires_grad=True)]

        def loss_fn() -> torch.Tensor:
            return ((a @ params[0] + params[1] - b) ** 2).mean()
    optimizer = make(params)

    def closure() -> torch.Tensor:
        loss = loss_fn()
        loss.backward()
        return loss

    def step() -> object:
        optimizer.zero_grad()
        return optimizer.step(closure)

    return step


OPTIMIZERS = {
    # name: (optimizer, torch baseline)
    "SAM-SGD": (lambda p: SAM(p, torch.optim.SGD, rho=0.05, lr=1e-2), lambda p: torch.optim.SGD(p, lr=1e-2)),
    "SAM-adaptive-SGD": (
        lambda p: SAM(p, torch.optim.SGD, rho=0.05, adaptive=True, lr=1e-2),
        lambda p: torch.optim.SGD(p, lr=1e-2),
    ),
    # torch's Adam reads its CPU-resident step counter (free on a GPU, counted on a CPU): SAM adds nothing to it
    "SAM-Adam": (lambda p: SAM(p, torch.optim.Adam, rho=0.05, lr=1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    "BayesianSAM": (lambda p: BayesianSAM(p, num_data=64), lambda p: torch.optim.SGD(p, lr=1e-2)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("network", ["least-squares", "resnet"])
def test_optimizer_step_makes_no_host_sync(name, network):
    # torch optimisers' host-resident step counters (Adam's) are not counted: free on a GPU
    make, _ = OPTIMIZERS[name]
    rates, report = _per_step(_optimizer_step(make, network), (2,))
    assert rates == [0.0], f"{name} on {network}:\n{report}"


# ---------------------------------------------------------------------------------------------------------------------
# the cheaper sharpness-aware steps (LookSAM, RST, ESAM): their choices are made without reading a tensor

CHEAPER_OBJECTIVES = {
    # name: (objective, guide class, model transform, warm-up steps: the compiled one captures each kind of step)
    "SharpnessAwareELBO-looksam": (lambda: SharpnessAwareELBO(0.05, looksam_k=2), AutoNormal, None, 1),
    "SharpnessAwareELBO-rst": (lambda: SharpnessAwareELBO(0.05, rst_p=0.5), AutoDelta, None, 1),
    "sharpness_aware-looksam": (TensorTrace_ELBO, AutoNormal, lambda m: sharpness_aware(m, 0.05, looksam_k=2), 1),
    "JitSharpnessAwareELBO-looksam": (
        lambda: JitSharpnessAwareELBO(0.05, looksam_k=2, **UNCOMPILED), AutoNormal, None, 5),
}


@pytest.mark.parametrize("name", list(CHEAPER_OBJECTIVES))
def test_cheaper_objective_steps_make_no_host_read(name):
    pyro.enable_validation(False)
    make, guide_class, transform, warmup = CHEAPER_OBJECTIVES[name]
    step = _svi_step(make(), guide_class, transform, svi_class=TensorSVI)
    for _ in range(warmup):
        step()
    rates, report = _per_step(step, (4,))  # both kinds of step among them
    assert rates == [0.0], f"{name}:\n{report}"


@pytest.mark.parametrize("options", [{"looksam_k": 2}, {"rst_p": 0.5}, {"esam_gamma": 0.5}])
@pytest.mark.parametrize("make", [lambda p, **o: SAM(p, torch.optim.SGD, rho=0.05, lr=1e-2, **o),
                                  lambda p, **o: BayesianSAM(p, num_data=64, **o)], ids=["SAM", "BayesianSAM"])
def test_cheaper_optimizer_steps_make_no_host_sync(make, options):
    if "esam_gamma" not in options:
        rates, report = _per_step(_optimizer_step(partial(make, **options)), (4,))
        assert rates == [0.0], report
        return
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 6, generator=generator), torch.randn(32, generator=generator)
    params = [torch.zeros(6, requires_grad=True), torch.zeros((), requires_grad=True)]
    optimizer = make(params, **options)

    def closure(subset: torch.Tensor | None) -> torch.Tensor:  # ESAM's: per-example losses, no backward
        rows = slice(None) if subset is None else subset
        return (a[rows] @ params[0] + params[1] - b[rows]) ** 2

    rates, report = _per_step(lambda: optimizer.step(closure), (4,))
    assert rates == [0.0], report


# ---------------------------------------------------------------------------------------------------------------------
# collectors and streaming accumulators (called once per draw or per epoch)


@pytest.mark.parametrize("network", list(NETWORKS))
def test_collectors_and_streaming_bma_make_no_host_sync(network):
    pyro.enable_validation(False)
    make_model, make_data = NETWORKS[network]
    x, y = make_data()
    model = make_model()
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    draws = list(guide_draws(guide, 3, x[:2], y[:2]))
    swag, hwa, bma = SWAGCollector(2), HWA(guide, max_rank=2), StreamingBMA()
    hook = DrawHook(lambda draw: bma.update(predict_logits(model, draw, x)))
    kernel, _ = _kernel_chain("SGLD", network=network)
    with HostSyncCounter() as syncs:
        for draw in draws:
            swag.collect(draw)
            hwa.collect()
            bma.update(predict_logits(model, draw, x))
            hook(kernel, kernel.initial_params, "Sample", 0)
        list(guide_draws(guide, 3, x[:2], y[:2]))
    assert syncs.count == 0, syncs.report()


def _held_bytes(obj: object) -> int:
    """Bytes of the tensors an accumulator holds (its attributes, one level of containers deep)."""
    return sum(t.numel() * t.element_size() for t in _floating(vars(obj)) + [
        v for v in vars(obj).values() if isinstance(v, torch.Tensor) and not v.is_floating_point()
    ]) + sum(_held_bytes(v) for v in vars(obj).values() if hasattr(v, "__dict__") and type(v).__module__.startswith(
        "pyro_flat"))


def test_streaming_accumulators_hold_bounded_memory():
    # SWAG keeps K deviations whatever the number of draws; the streaming BMA keeps O(N C); DrawHook keeps nothing
    rank, size = 3, 50
    swag, bma = SWAGCollector(rank), StreamingBMA()
    hook = DrawHook(lambda draw: bma.update(draw["w"]))
    kernel = SGLD(potential_fn=lambda p: (p["w"] ** 2).sum(), step_size=0.1)
    held = []
    for k in range(1, 41):
        swag.collect({"w": torch.randn(size)})
        hook(kernel, {"w": torch.randn(7, 3)}, "Sample", k)
        if k in (rank, 40):
            held.append((_held_bytes(swag), _held_bytes(bma), _held_bytes(hook)))
    assert held[0] == held[1]
    assert held[1][0] == (3 + rank) * size * 8  # mean, mean of squares, the reused flat iterate, K deviations (f64)
    assert swag.num_collected == 40 and bma.num_samples == 40 and hook.num_draws == 40


# ---------------------------------------------------------------------------------------------------------------------
# dtype walk: the model's dtype everywhere, no op mixing two floating dtypes


class _DtypeMixing(TorchDispatchMode):
    """Records the operations that combine floating tensors (of one element or more dimensions) of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        dtypes = {t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim > 0}
        if len(dtypes) > 1:
            self.mixed.append(f"{func}: {sorted(map(str, dtypes))}")
        return func(*args, **kwargs)


def test_dtype_mixing_detector_sees_a_tensor_made_in_the_default_dtype():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(3, dtype=torch.float64)
    with _DtypeMixing() as mixing:
        _ = x + torch.ones(3)  # the bug the walk looks for: no dtype=x.dtype
        _ = x + torch.ones(3, dtype=x.dtype) + torch.tensor(1.0)  # fine (a 0-dim tensor is a scalar)
    assert len(mixing.mixed) == 1 and "aten.add.Tensor" in mixing.mixed[0]


@pytest.fixture(params=[torch.float32, torch.float64], ids=["float32", "float64"])
def model_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """The model's dtype; torch's default dtype is set to the other one so a tensor made without dtype= shows."""
    torch.set_default_dtype(torch.float64 if request.param == torch.float32 else torch.float32)
    return request.param


def _floating(tensors: object) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors] if tensors.is_floating_point() else []
    if isinstance(tensors, dict):
        return [t for v in tensors.values() for t in _floating(v)]
    if isinstance(tensors, (list, tuple)):
        return [t for v in tensors for t in _floating(v)]
    return []


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_objective_keeps_the_model_dtype(name, model_dtype):
    make, guide_class, transform = OBJECTIVES[name]
    x, y = _data(dtype=model_dtype)
    model = _model(dtype=model_dtype)
    fitted = model if transform is None else transform(model)
    guide = guide_class(fitted, rank=2) if guide_class is AutoLowRankPlusDiagonalNormal else guide_class(fitted)
    guide(x[:2], y[:2])  # the guide's parameters follow the model's values
    svi = SVI(fitted, guide, pyro.optim.Adam({"lr": 1e-2}), make())
    with _DtypeMixing() as mixing:
        for _ in range(2):
            svi.step(x, y, subsample_size=B)
    assert not mixing.mixed, mixing.mixed[:5]
    params = dict(pyro.get_param_store().items())
    assert params and {p.dtype for p in params.values()} == {model_dtype}
    draw = next(guide_draws(guide, 1, x[:2], y[:2]))
    assert {v.dtype for v in draw.values()} == {model_dtype}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_keeps_the_model_dtype(name, model_dtype):
    kernel, step = _kernel_chain(name, dtype=model_dtype)
    with _DtypeMixing() as mixing:
        params = [step() for _ in range(3)][-1]
    assert not mixing.mixed, mixing.mixed[:5]
    assert {v.dtype for v in params.values()} == {model_dtype}
    state = [t for t in _floating(vars(kernel)) if t.ndim > 0]  # momenta, inner chains, anchors
    assert {t.dtype for t in state} <= {model_dtype}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_keeps_the_parameters_dtype(name, model_dtype):
    make, _ = OPTIMIZERS[name]
    params = [torch.randn(4, 3, dtype=model_dtype, requires_grad=True), torch.randn(3, dtype=model_dtype,
                                                                                    requires_grad=True)]
    optimizer = make(params)

    def closure() -> torch.Tensor:
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    with _DtypeMixing() as mixing:
        for _ in range(2):
            optimizer.zero_grad()
            optimizer.step(closure)
    assert not mixing.mixed, mixing.mixed[:5]
    assert {p.dtype for p in params} == {model_dtype}
    inner = getattr(optimizer, "base_optimizer", optimizer)  # SAM keeps its state in the base optimizer
    state = [t for t in _floating([list(s.values()) for s in inner.state.values()]) if t.ndim > 0]
    assert {t.dtype for t in state} <= {model_dtype}
    assert state or name.endswith("SGD")  # plain SGD has no state
    if isinstance(optimizer, BayesianSAM):
        assert {t.dtype for t in optimizer.sample_params()} == {model_dtype}


def test_collectors_keep_the_values_dtype(model_dtype):
    values = [{"w": torch.randn(3, 2, dtype=model_dtype), "b": torch.randn(2, dtype=model_dtype)} for _ in range(3)]
    swag, bma = SWAGCollector(2), StreamingBMA()
    with _DtypeMixing() as mixing:
        for value in values:
            swag.collect(value)
            bma.update(torch.randn(5, 3, dtype=model_dtype))
    assert not mixing.mixed, mixing.mixed[:5]
    assert {swag.flat_mean().dtype, swag.deviation_matrix().dtype, bma.log_probs.dtype} == {model_dtype}


# ---------------------------------------------------------------------------------------------------------------------
# no tensor made by pyro_flat on the default device (a factory without device=, e.g. torch.zeros(n), lands on the CPU
# when the model is on a GPU), from construction on: making a network Bayesian, the guide's first call, the kernel's
# set-up, the optimizer's and collectors' first state

_FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.randn, torch.rand, torch.randint,
    torch.randperm, torch.tensor, torch.as_tensor, torch.linspace, torch.logspace, torch.eye, torch.scalar_tensor,
}


class _FactoriesWithoutDevice(TorchFunctionMode):
    """Records tensor factories called from pyro_flat's code without ``device=`` (``as_tensor`` of a tensor keeps
    its device and is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and not (
            func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
        ):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename), None)
            if frame is not None and "/pyro_flat/" in frame.filename and "/tests/" not in frame.filename:
                self.calls.append(f"torch.{func.__name__} at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}")
        return func(*args, **kwargs)


def test_factory_detector_sees_a_factory_without_device():
    from pyro_flat.ops.tree import flatten

    with _FactoriesWithoutDevice() as factories:
        flatten([torch.ones(2)])  # pyro_flat code making no tensor from a factory
        torch.zeros(3)  # test code: not counted
    assert factories.calls == []
    with _FactoriesWithoutDevice() as factories:
        SWAGCollector(2).collect({"w": torch.ones(3)})  # allocates with device=first.device
    assert factories.calls == []


CONSTRUCTIONS = {
    # name: a Bayesian model made from a torch network (a ResNet: convolutions, BatchNorm, a linear head)
    "make_bayesian": make_bayesian,  # packed, the default
    "make_bayesian-per-tensor": partial(make_bayesian, packed=False),
    "make_bayesian-norm_and_head-current-learned": partial(make_bayesian, random="norm_and_head",
                                                           prior_loc="current", rest="learned"),
    "pack_latents": lambda net: pack_latents(make_bayesian(net, packed=False)),
    "bayesian_transfer": lambda net: bayesian_transfer(net, 4),
    "bayesian_transfer-per-tensor": lambda net: bayesian_transfer(net, 4, packed=False),
}


def _convnet() -> nn.Sequential:
    """A small network with what ``CONSTRUCTIONS`` treat differently: a convolution, a normalisation layer, a head."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _repeat(step: Callable[[], object], times: int = 3) -> None:
    for _ in range(times):
        step()


@pytest.mark.parametrize("family", ["construction", "objectives", "kernels", "optimizers", "collectors", "metrics"])
def test_no_tensor_is_made_on_the_default_device(family):
    # each run builds what it steps (the torch networks are built beforehand: a network built from scratch lands on
    # the default device by design, as torch's), then steps it
    pyro.enable_validation(False)
    runs: dict[str, Callable[[], object]] = {}
    if family == "construction":
        runs = {name: partial(make, _convnet()) for name, make in CONSTRUCTIONS.items()}
    elif family == "objectives":
        for name, (make, guide_class, transform) in OBJECTIVES.items():
            runs[name] = partial(lambda *a, model: _repeat(_svi_step(a[0](), *a[1:], model=model)),
                                 make, guide_class, transform, model=_model())
    elif family == "kernels":
        for name in KERNELS:
            runs[name] = partial(lambda n, m: _repeat(_kernel_chain(n, model=m, divergence_check_every=2)[1]),
                                 name, _model())
    elif family == "optimizers":
        for name, (make, _) in OPTIMIZERS.items():
            runs[name] = partial(lambda m: _repeat(_optimizer_step(m)), make)
    elif family == "collectors":
        x, y = _data()
        model = _model()

        def collect_and_predict() -> None:
            guide = AutoNormal(model)
            guide(x[:2], y[:2])
            swag, hwa, bma = SWAGCollector(2), HWA(guide, max_rank=2), StreamingBMA()
            for draw in guide_draws(guide, 3, x[:2], y[:2]):
                swag.collect(draw)
                hwa.collect()
                bma.update(predict_logits(model, draw, x))
            for posterior in (swag.guide(model), hwa.averaged_guide(model),
                              AutoLowRankPlusDiagonalNormal.from_swag(model, swag)):
                bma_predict(model, guide_draws(posterior, 2, x[:2], y[:2]), x)

        runs = {"collect and predict": collect_and_predict}
    else:
        from pyro_flat import metrics

        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(4, 20, 3, generator=generator)
        y = torch.randint(0, 3, (20,), generator=generator)
        probs = metrics.bma_probs(logits)
        runs = {
            "evaluate": lambda: metrics.evaluate(probs, y, ood_predictions=probs.flip(0)),
            "streaming": lambda: metrics.evaluate(StreamingBMA().update(logits), y),
            "calibration": lambda: metrics.reliability_bins(probs, y),
            "uncertainty": lambda: (metrics.mutual_information(logits.softmax(-1)),
                                    metrics.ood_aupr(probs[:, 0], probs[:, 1])),
        }
    for name, run in runs.items():
        with _FactoriesWithoutDevice() as factories:
            run()
        assert not factories.calls, f"{name}: {sorted(set(factories.calls))}"


# ---------------------------------------------------------------------------------------------------------------------
# on a device: every family built and stepped where the model lives, without host synchronisation after its set-up.
# `meta` is the CPU twin of CUDA (no data, so no value is ever read: a host read fails, a tensor left on the CPU
# fails in the first operation that meets it; HostSyncCounter sees the copies and reads that CUDA would make);
# "cuda" runs the same tests under CUDA's sync-debug mode (skipped without a GPU). Fake "cuda" tensors
# (FakeTensorMode) were no alternative here: without a CUDA driver, autograd's engine refuses them in backward.

DEVICES = ["meta", pytest.param("cuda", marks=pytest.mark.cuda)]
# meta runs torch's Python meta kernels (about a millisecond an operation): every objective and kernel on the MLP,
# one of each kind on the packed ResNet (BatchNorm statistics, one packed site, the low-rank guide)
ON_META_RESNET = {"TensorTrace_ELBO", "SharpnessAwareELBO", "KLBallELBO-lowrank", "SGLD", "EntropyMCMC"}


def _elsewhere(tensors: dict[str, torch.Tensor], device: str) -> list[str]:
    """The names of the floating tensors of ``tensors`` that are not on the device type ``device``."""
    return [name for name, t in tensors.items() if t.is_floating_point() and t.device.type != device]


@pytest.mark.parametrize("name", list(CONSTRUCTIONS))
def test_a_network_made_bayesian_where_it_lives_stays_there(name, model_dtype):
    # make_bayesian(net.cuda()): every buffer it adds on the network's device, in its dtype (a ResNet-18 on meta)
    with torch.device("meta"):
        net = resnet18(10).to(model_dtype)
    model = CONSTRUCTIONS[name](net)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    elsewhere = _elsewhere(tensors, "meta")
    assert not elsewhere, f"{len(elsewhere)} tensors not on the network's device: {elsewhere}"
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {model_dtype}
    assert {v.device.type for v in latent_init_values(model).values()} == {"meta"}


@pytest.mark.parametrize(("name", "network", "device"), [
    *[(name, network, "meta") for name in OBJECTIVES for network in NETWORKS
      if network == "mlp" or name in ON_META_RESNET],
    *[pytest.param(name, network, "cuda", marks=pytest.mark.cuda) for name in OBJECTIVES for network in NETWORKS
      if network == "mlp" or name not in CAPTURED],
])
def test_objective_steps_on_the_device_without_host_sync(name, network, device, no_host_sync):
    # TensorSVI and the tensor objectives make no host read: every objective steps on meta too. Validation off (its
    # checks read values by design)
    pyro.enable_validation(False)
    make, guide_class, transform = OBJECTIVES[name]
    model = NETWORKS[network][0](device)
    step = _svi_step(make(), guide_class, transform, network=network, svi_class=TensorSVI, device=device, model=model)
    # set-up: the guide's and the optimizer's state; the compiled ones: capture, then compilation. On CUDA, as many
    # steps for every objective (its lazy initialisations)
    for _ in range(4 if name in CAPTURED or device == "cuda" else 1):
        step()
    with no_host_sync(device):
        losses = [step() for _ in range(2)]
    assert {loss.device.type for loss in losses} == {device}
    if device != "meta":
        assert torch.isfinite(torch.stack(losses)).all()
    params = dict(pyro.get_param_store().items())
    assert params and not _elsewhere(params, device), _elsewhere(params, device)
    buffers = dict(model.named_buffers())
    assert not _elsewhere(buffers, device), _elsewhere(buffers, device)


@pytest.mark.parametrize(("name", "network", "device"), [
    *[(name, network, "meta") for name in KERNELS for network in NETWORKS
      if network == "mlp" or name in ON_META_RESNET],
    *[pytest.param(name, network, "cuda", marks=pytest.mark.cuda) for name in KERNELS for network in NETWORKS],
])
def test_kernel_steps_on_the_device_without_host_sync(name, network, device, no_host_sync):
    pyro.enable_validation(False)
    kernel, step = _kernel_chain(name, device, torch.float32, network=network, divergence_check_every=10_000)
    step()  # set-up: the chain's state
    with no_host_sync(device):
        params = [step() for _ in range(2)][-1]
    assert {v.device.type for v in params.values()} == {device}
    state = _floating(vars(kernel))  # momenta, inner chains, anchors, the divergence record
    assert state and {t.device.type for t in state} == {device}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_closure_optimizer_steps_on_the_device_without_host_sync(name, device, no_host_sync):
    make, _ = OPTIMIZERS[name]
    params = [torch.randn(4, 3, device=device, requires_grad=True), torch.randn(3, device=device, requires_grad=True)]
    optimizer = make(params)

    def closure() -> torch.Tensor:
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    optimizer.step(closure)  # set-up: the state
    with no_host_sync(device):
        for _ in range(2):
            optimizer.zero_grad()
            optimizer.step(closure)
    inner = getattr(optimizer, "base_optimizer", optimizer)  # SAM keeps its state in the base optimizer
    state = [t for t in _floating([list(s.values()) for s in inner.state.values()]) if t.ndim > 0]
    assert {t.device.type for t in [*params, *state]} == {device}  # not Adam's step counter: torch keeps it on the host


@pytest.mark.parametrize("device", DEVICES)
def test_collectors_and_posterior_guides_on_the_device_without_host_sync(device, no_host_sync):
    pyro.enable_validation(False)
    x, y = _data(device)
    model = _model(device)
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    swag, hwa, bma = SWAGCollector(3), HWA(guide, max_rank=3), StreamingBMA()
    hook = DrawHook(lambda draw: bma.update(predict_logits(model, draw, x)))
    draws = list(guide_draws(guide, 4, x[:2], y[:2]))
    swag.collect(draws[0])  # set-up: the first collection allocates
    hwa.collect()
    hook(None, draws[0], "Sample", 0)
    with no_host_sync(device):
        for k, draw in enumerate(draws[1:], 1):
            swag.collect(draw)
            hwa.collect()
            hook(None, draw, "Sample", k)
    guides = {
        "AutoSWAG": swag.guide(model),
        "AutoSWAG-diagonal": swag.guide(model, diagonal_only=True),
        "AutoLowRankPlusDiagonalNormal.from_swag": AutoLowRankPlusDiagonalNormal.from_swag(model, swag),
        "HWA.averaged_guide": hwa.averaged_guide(model),
    }
    for name, posterior in guides.items():
        next(guide_draws(posterior, 1, x[:2], y[:2]))  # set-up
        with no_host_sync(device):
            draw = next(guide_draws(posterior, 1, x[:2], y[:2]))
            predictive = bma_predict(model, guide_draws(posterior, 2, x[:2], y[:2]), x)
        tensors = {**draw, **dict(posterior.named_parameters()), **dict(posterior.named_buffers()),
                   "bma_predict": predictive._log_sum_probs}  # log_probs checks the values on the host
        assert not _elsewhere(tensors, device), f"{name}: {_elsewhere(tensors, device)}"
    collected = [swag.flat_mean(), swag.deviation_matrix(), bma._log_sum_probs, *_floating(vars(hwa)),
                 *_floating(vars(hwa.means))]
    assert {t.device.type for t in collected} == {device}

"""Device-agnostic checks of every public objective, kernel, optimizer, guide helper and streaming accumulator.

* Host synchronisations per step, counted on the CPU by :class:`pyro_flat.testing.HostSyncCounter`: they must not
  grow with the number of steps, and pyro_flat adds none beyond its Pyro/torch baseline (Pyro's ``SVI.step`` and
  ``Trace_ELBO`` read the loss as Python floats: that is Pyro's choice and the baseline).
* dtype walk: a float32 and a float64 model, each under the *other* default dtype (so a tensor made without
  ``dtype=`` shows), keep their dtype in guide parameters, samples, kernel states and optimizer states, and no
  operation mixes two floating dtypes.
* meta-device walk where Pyro allows it (kernels, optimizers, collectors; Pyro's ELBOs read scalars with
  ``torch_item`` and cannot run on ``meta``, so the ELBOs rely on the dtype walk and the sync count).
* CUDA smoke tests per family under ``torch.cuda.set_sync_debug_mode("error")`` (skipped without a GPU).
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
from pyro_flat.nn import BayesianClassifier, BayesianMLP, init_to_network, make_bayesian, resnet18
from pyro_flat.optim import SAM, BayesianSAM
from pyro_flat.testing import HostSyncCounter

B = 16  # minibatch size


def _data(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=generator, dtype=dtype).to(device)
    y = torch.randint(0, 3, (64,), generator=generator).to(device)
    return x, y


def _model(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> BayesianMLP:
    return BayesianMLP(5, 3, hidden=(8,)).to(device=device, dtype=dtype)


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
    """ResNet-18 (width 4) with its weights packed in one site, as the harness builds it."""
    torch.manual_seed(0)
    net = make_bayesian(resnet18(3, width=4), packed=True)
    return BayesianClassifier(net, 3).to(device=device, dtype=dtype)


def _images(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 8, 8, generator=generator, dtype=dtype).to(device)
    return x, torch.randint(0, 3, (32,), generator=generator).to(device)


NETWORKS = {"mlp": (_model, _data), "resnet-packed": (_resnet, _images)}


def _svi_step(loss: object, guide_class: type, transform: Callable | None = None, *, network: str = "mlp",
              svi_class: type | tuple[type, ...] = SVI, device: torch.device | str = "cpu") -> Callable[[], object]:
    """An SVI step; with a tuple of SVI classes, one step of each on the same model, guide and objective."""
    pyro.clear_param_store()
    make_model, make_data = NETWORKS[network]
    x, y = make_data(device)
    model = make_model(device)
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
                  network: str = "mlp", **kwargs: object):
    make_model, make_data = NETWORKS[network]
    x, y = make_data(device, dtype)
    model = make_model(device, dtype)
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


def test_posterior_guides_sample_without_host_sync():
    pyro.enable_validation(False)
    x, y = _data()
    model = _model()
    guide = AutoNormal(model)
    guide(x[:2], y[:2])
    swag, hwa = SWAGCollector(3), HWA(guide, max_rank=3)
    for draw in guide_draws(guide, 4, x[:2], y[:2]):
        swag.collect(draw)
        hwa.collect()
    guides = {
        "AutoSWAG": swag.guide(model),
        "AutoSWAG-diagonal": swag.guide(model, diagonal_only=True),
        "AutoLowRankPlusDiagonalNormal.from_swag": AutoLowRankPlusDiagonalNormal.from_swag(model, swag),
        "HWA.averaged_guide": hwa.averaged_guide(model),
    }
    for name, posterior in guides.items():
        next(guide_draws(posterior, 1, x[:2], y[:2]))  # sets the guide up
        with HostSyncCounter() as syncs:
            bma_predict(model, guide_draws(posterior, 3, x[:2], y[:2]), x)
        assert syncs.count == 0, f"{name}:\n{syncs.report()}"


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
# when the model is on a GPU)

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


@pytest.mark.parametrize("family", ["objectives", "kernels", "optimizers", "collectors"])
def test_no_tensor_is_made_on_the_default_device(family):
    pyro.enable_validation(False)
    steps: dict[str, Callable[[], object]] = {}
    if family == "objectives":
        for name, (make, guide_class, transform) in OBJECTIVES.items():
            steps[name] = _svi_step(make(), guide_class, transform)
    elif family == "kernels":
        for name in KERNELS:
            steps[name] = _kernel_chain(name, divergence_check_every=2)[1]
    elif family == "optimizers":
        for name, (make, _) in OPTIMIZERS.items():
            steps[name] = _optimizer_step(make)
    else:
        x, y = _data()
        model = _model()
        guide = AutoNormal(model)
        guide(x[:2], y[:2])
        swag, hwa = SWAGCollector(2), HWA(guide, max_rank=2)

        def collect() -> None:
            draw = next(guide_draws(guide, 1, x[:2], y[:2]))
            swag.collect(draw)
            hwa.collect()

        def predict() -> None:
            bma_predict(model, guide_draws(swag.guide(model), 2, x[:2], y[:2]), x)
            bma_predict(model, guide_draws(hwa.averaged_guide(model), 2, x[:2], y[:2]), x)

        steps = {"collect": collect, "predict": predict}
    for name, step in steps.items():
        step()
        with _FactoriesWithoutDevice() as factories:
            for _ in range(3):
                step()
        assert not factories.calls, f"{name}: {sorted(set(factories.calls))}"


# ---------------------------------------------------------------------------------------------------------------------
# meta device: tensors follow the model's device (Pyro's ELBOs cannot run on meta: they read scalars)


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_runs_on_the_meta_device(name):
    pyro.enable_validation(False)
    kernel, step = _kernel_chain(name, device="meta", divergence_check_every=10_000)
    params = [step() for _ in range(2)][-1]
    assert {v.device.type for v in params.values()} == {"meta"}
    assert {t.device.type for t in _floating(vars(kernel))} <= {"meta"}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_runs_on_the_meta_device(name):
    make, _ = OPTIMIZERS[name]
    if name == "SAM-Adam":
        pytest.skip("torch's Adam reads its step counter as a Python number, which meta tensors do not have")
    params = [torch.randn(4, 3, device="meta", requires_grad=True)]
    optimizer = make(params)

    def closure() -> torch.Tensor:
        loss = (params[0] ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    state = _floating([list(s.values()) for s in optimizer.state.values()])
    assert {t.device.type for t in [*params, *state]} == {"meta"}


def test_collectors_run_on_the_meta_device():
    swag, bma = SWAGCollector(2), StreamingBMA()
    for _ in range(3):
        swag.collect({"w": torch.empty(3, 2, device="meta")})
        bma.update(torch.empty(5, 3, device="meta"))
    assert swag.flat_mean().device.type == "meta" and swag.deviation_matrix().device.type == "meta"
    assert bma._log_sum_probs.device.type == "meta"


# ---------------------------------------------------------------------------------------------------------------------
# CUDA smoke tests (skipped without a GPU): every family on the GPU, kernels/optimizers/collectors sync-free


@pytest.mark.cuda
@pytest.mark.parametrize("network", list(NETWORKS))
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_objective_on_cuda_without_sync(name, network, cuda_sync_errors):
    # validation off (its checks read values by design); the guide sets itself up in the first step
    pyro.enable_validation(False)
    make, guide_class, transform = OBJECTIVES[name]
    torch.set_default_dtype(torch.float32)
    with torch.cuda.device(0):
        torch.cuda.set_sync_debug_mode(0)
        step = _svi_step(make(), guide_class, transform, network=network, svi_class=TensorSVI, device="cuda")
        for _ in range(4):  # set-up; the compiled ones: capture, then compilation (which may synchronise)
            step()
        torch.cuda.set_sync_debug_mode("error")
        losses = [step() for _ in range(2)]
    torch.cuda.set_sync_debug_mode(0)
    assert all(loss.device.type == "cuda" for loss in losses) and torch.isfinite(torch.stack(losses)).all()
    assert {p.device.type for _, p in pyro.get_param_store().items()} == {"cuda"}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_on_cuda_without_sync(name, cuda_sync_errors):
    pyro.enable_validation(False)
    _, step = _kernel_chain(name, "cuda", torch.float32, divergence_check_every=10_000)
    params = [step() for _ in range(3)][-1]
    assert {v.device.type for v in params.values()} == {"cuda"}


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["SAM-SGD", "BayesianSAM"])
def test_optimizer_on_cuda_without_sync(name, cuda_sync_errors):
    make, _ = OPTIMIZERS[name]
    params = [torch.randn(4, 3, device="cuda", requires_grad=True)]
    optimizer = make(params)

    def closure() -> torch.Tensor:
        loss = (params[0] ** 2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    assert params[0].device.type == "cuda"


@pytest.mark.cuda
def test_collectors_on_cuda_without_sync(cuda_sync_errors):
    swag, bma = SWAGCollector(2), StreamingBMA()
    for _ in range(3):
        swag.collect({"w": torch.randn(3, 2, device="cuda")})
        bma.update(torch.randn(5, 3, device="cuda"))
    assert swag.flat_mean().device.type == "cuda" and bma._log_sum_probs.device.type == "cuda"

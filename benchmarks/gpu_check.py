"""The GPU check: on a CUDA machine, one command runs the CUDA tests, the step table and the harness, and writes
``benchmarks/results/gpu_<device>.md`` (and the step rows as ``gpu_<device>.json``).

1. **Tests**: the CUDA-marked tests (``pytest -m cuda``) under the project's own pytest settings.
2. **Step table**: ResNet-18 (CIFAR stem, 11.2 M weights), batch 128, bf16 autocast, channels-last, random CIFAR-shaped
   data already on the device, validation off. For MAP, VI, SAM, F-VI, KL ball, SGLD, Entropy-SGLD and Entropy-MCMC:
   the packed Pyro step, eager and compiled (CUDA graphs); for the first six, the hand-written torch step doing the
   same arithmetic (``_svi_steps.py``, ``step_ops.py``: packed, eager and ``torch.compile``'d in one graph with CUDA
   graphs, the limit of a compiled step), each checked first to draw the same random numbers and compute the Pyro
   step's loss and gradients (SGLD: the same transition); and a plain ``nn.Module`` torch step, what a user writes
   instead: SGD and SAM, eager and with ``torch.compile(net)`` + fused SGD. ``--all-variants`` adds the Pyro steps per
   tensor and with Pyro's validation on, and the hand-written steps per tensor. Per variant: the median step time over
   the timed steps (CUDA events), images per second, host synchronisations per step (CUDA's sync-debug mode at
   ``"warn"``, its warnings counted), and from the profiler, over a few steps, the kernel launches per step and the
   GPU busy fraction (kernel time / wall time). Then the ratios of issue 27's goals, computed from the rows.
3. **Harness**: ``bench --compile`` for 2 epochs of every method with a compiled step in the table (``map``, ``vi``,
   ``sam``, ``f_vi``, ``sa_bma_diag``, ``sgld``, ``emcmc``) on generated CIFAR-format data (10,240 images,
   augmentation on the device): the second epoch's time against its steps x the compiled step alone.

``--parts`` picks the parts; ``--budget`` (seconds, default 540) bounds the whole run: what the budget leaves out is
noted. All of it takes longer than one budget on one H100 or H200 (each compilation is 20-60 s): run ``--parts steps``
and ``--parts tests harness`` as two commands; the harness part then reads the compiled step times from the
``gpu_<device>.json`` the steps part wrote. On a machine without Pyro, carry the wheels of ``pyro-ppl`` and
``pyro-api`` (the device tool's README) and put them on ``PYTHONPATH``; nothing else is needed beyond torch,
torchvision, pytest, scikit-learn and matplotlib.

Run: ``python benchmarks/gpu_check.py`` (on a GPU); ``python benchmarks/gpu_check.py --smoke --device cpu`` runs every
part at toy size on a CPU (what CI checks; there the host synchronisations are pyro_flat's CPU proxy,
``pyro_flat.testing.HostSyncCounter``, the launches the ATen operations that are not views, and the harness runs
eager: its compiled path is ``tests/bench/test_flat_seeking.py``'s).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pyro
import torch
import torch.nn.functional as F
from _svi_steps import LR, TorchBBB, TorchMAP, check_same_step, functional_forward, packed_torch, sam_ascent
from kl_ball_elbo import RADIUS, TorchKLBall
from pyro.infer.autoguide import AutoDelta, AutoNormal
from sharpness_aware_elbo import RHO, TorchBBBSAM
from step_ops import ETA, STEP_SIZE, OpCounter, TorchSGLDStep, check_same_transition
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from pyro_flat.infer import (
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    JitTensorTrace_ELBO,
    KLBallELBO,
    SharpnessAwareELBO,
    TensorSVI,
    TensorTrace_ELBO,
)
from pyro_flat.infer.mcmc import SGLD, EntropyMCMC, EntropySGLD
from pyro_flat.nn import BayesianClassifier, init_to_network, make_bayesian, resnet18
from pyro_flat.testing import HostSyncCounter

ROOT = Path(__file__).resolve().parents[1]
INNER_STEPS = 5  # Entropy-SGLD's L: a transition is L gradient steps, timed per gradient step
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}  # the plain torch step's optimiser (the usual CIFAR recipe)
HAND_WRITTEN = {"MAP": (TorchMAP, {}), "VI": (TorchBBB, {}), "SAM": (TorchMAP, {"rho": RHO}),
                "F-VI": (TorchBBBSAM, {}), "KL ball": (TorchKLBall, {}), "SGLD": (TorchSGLDStep, {})}
KERNELS = {"SGLD": (SGLD, {}), "Entropy-SGLD": (EntropySGLD, {"eta": ETA, "num_inner_steps": INNER_STEPS}),
           "Entropy-MCMC": (EntropyMCMC, {"eta": ETA})}
METHODS = [*HAND_WRITTEN, "Entropy-SGLD", "Entropy-MCMC"]
HARNESS = {"map": "MAP", "vi": "VI", "sam": "SAM", "f_vi": "F-VI", "sa_bma_diag": "KL ball", "sgld": "SGLD",
           "emcmc": "Entropy-MCMC"}  # the harness's methods with a compiled step in the table
PLAIN = "plain torch"
PYRO, PYRO_COMPILED, TORCH, TORCH_COMPILED = "Pyro packed", "Pyro packed, compiled", "torch packed", \
    "torch packed, compiled"
PLAIN_SGD, PLAIN_SAM = "SGD", "SAM"
PLAIN_COMPILED = ", torch.compile(net) + fused SGD"


class Setup:
    """The network and data of the step table."""

    def __init__(self, device: torch.device, width: int, batch: int, num_data: int, precision: str,
                 channels_last: bool, image: int = 32) -> None:
        self.device, self.batch, self.precision, self.channels_last = device, batch, precision, channels_last
        generator = torch.Generator().manual_seed(0)  # the same data on every device: drawn on the CPU, then moved
        self.x = torch.randn(num_data, 3, image, image, generator=generator, device="cpu").to(device)
        if channels_last:
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, 10, (num_data,), generator=generator, device="cpu").to(device)
        torch.manual_seed(0)
        self.net = resnet18(10, width=width).to(device)
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)
        self._forward = functional_forward(self.net)
        self.autocast = torch.bfloat16 if precision == "bf16" else None
        self.size = sum(p.numel() for p in self.net.parameters())

    def model(self, packed: bool) -> BayesianClassifier:
        net = make_bayesian(copy.deepcopy(self.net), packed=packed)
        return BayesianClassifier(net, 10, autocast=self.autocast)

    def autocast_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def forward(self, weights, x, update_stats: bool = True):
        with self.autocast_context():
            return self._forward(weights, x, update_stats).float()

    def torch_args(self, packed: bool):
        params = list(self.net.parameters())
        return packed_torch(params, self.forward) if packed else (params, self.forward)


class PyroStep:
    """A ``TensorSVI`` step (or an SG-MCMC transition) of one variant; ``units`` gradient steps a call."""

    def __init__(self, setup: Setup, method: str, packed: bool, compiled: bool,
                 jit_options: dict | None = None) -> None:
        pyro.clear_param_store()
        self.setup, self.method, self.units = setup, method, 1
        model = setup.model(packed)
        self.model = model
        if method in KERNELS:
            kernel, options = KERNELS[method]
            self.kernel = kernel(model, step_size=STEP_SIZE, init_strategy=init_to_network(model),
                                 divergence_check_every=10**9, jit_compile=compiled, jit_options=jit_options,
                                 **options)
            self.kernel.setup(0, setup.x, setup.y, subsample_size=setup.batch)
            self.params = self.kernel.initial_params
            self.units = options.get("num_inner_steps", 1)
            return
        guide_class = AutoDelta if method in ("MAP", "SAM") else AutoNormal
        options = {} if guide_class is AutoDelta else {"init_scale": 1e-3}
        self.guide = guide_class(model, init_loc_fn=init_to_network(model), **options)
        jit = {"jit_options": jit_options} if compiled else {}
        if method == "KL ball":
            self.loss = (JitKLBallELBO if compiled else KLBallELBO)(RADIUS, **jit)
        elif method in ("SAM", "F-VI"):
            self.loss = (JitSharpnessAwareELBO if compiled else SharpnessAwareELBO)(RHO, **jit)
        else:
            self.loss = (JitTensorTrace_ELBO if compiled else TensorTrace_ELBO)(**jit)
        self.guide(setup.x[: setup.batch], setup.y[: setup.batch], subsample_size=setup.batch)
        self.svi = TensorSVI(model, self.guide, pyro.optim.Adam({"lr": LR}), self.loss)

    def __call__(self) -> None:
        if hasattr(self, "kernel"):
            self.params = self.kernel.sample(self.params)
        else:
            self.svi.step(self.setup.x, self.setup.y, subsample_size=self.setup.batch)

    def loss_and_grads(self):
        """For ``_svi_steps.check_same_step``: the loss and gradients in the hand-written step's order."""
        store = pyro.get_param_store()
        loss = self.loss.differentiable_loss(self.model, self.guide, self.setup.x, self.setup.y,
                                             subsample_size=self.setup.batch)
        names = list(store.keys())
        if not isinstance(self.guide, AutoDelta):
            names = [n for n in names if ".locs." in n] + [n for n in names if ".scales." in n]
        return loss.detach(), list(torch.autograd.grad(loss, [store._params[n] for n in names]))


def torch_step(setup: Setup, method: str, packed: bool, compile_options: dict | None = None) -> Callable[[], None]:
    """The hand-written step of ``method`` (eager, or ``torch.compile``'d with ``compile_options``)."""
    cls, options = HAND_WRITTEN[method]
    params, forward = setup.torch_args(packed)
    if cls is TorchSGLDStep:
        return TorchSGLDStep(setup.x, setup.y, params, forward, setup.batch, compile_options=compile_options)
    return cls(setup.x, setup.y, params, forward, setup.batch, compile_options=compile_options, **options)


def check(setup: Setup, method: str, packed: bool, step: object) -> float:
    """The largest relative difference between a hand-written step and the Pyro step of the same method (the same
    random numbers checked first: ``_svi_steps.check_same_draws``)."""
    reference = PyroStep(setup, method, packed, False)
    if method in KERNELS:
        return check_same_transition(reference, step)
    return check_same_step(reference, step)


class PlainTorch:
    """What a user writes instead of a Bayesian step: the ``nn.Module`` itself and ``torch.optim.SGD`` (rate 0.05,
    momentum 0.9, weight decay 5e-4: the usual CIFAR recipe) on the mean cross-entropy of a minibatch drawn on the
    device, with the setup's autocast; ``sam``: SAM's two passes (the ascent ``rho g / |g|``, the gradient there, the
    step from the original weights); ``compile_options``: ``torch.compile(net, **compile_options)`` and fused SGD where
    the device has it."""

    def __init__(self, setup: Setup, sam: bool, compile_options: dict | None = None) -> None:
        self.setup, self.sam = setup, sam
        self.net = copy.deepcopy(setup.net)
        self.params = list(self.net.parameters())
        self.model = self.net if compile_options is None else torch.compile(self.net, **compile_options)
        fused = compile_options is not None and setup.device.type in _get_fused_kernels_supported_devices()
        self.optim = torch.optim.SGD(self.params, **SGD, **({"fused": True} if fused else {}))

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optim.zero_grad(set_to_none=True)
        with self.setup.autocast_context():
            logits = self.model(x)
        F.cross_entropy(logits.float(), y).backward()

    def step(self) -> None:
        setup = self.setup
        idx = torch.randperm(len(setup.x), device=setup.x.device)[: setup.batch]
        x, y = setup.x[idx], setup.y[idx]
        self.backward(x, y)
        if self.sam:
            with torch.no_grad():
                ascent = sam_ascent([p.grad for p in self.params], RHO)
                torch._foreach_add_(self.params, ascent)
            self.backward(x, y)
            with torch.no_grad():
                torch._foreach_sub_(self.params, ascent)
        self.optim.step()


# ---------------------------------------------------------------------------------------------------------------------
# measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds per step (CUDA events on a GPU, wall time otherwise) after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    return times


def host_syncs(step: Callable[[], None], device: torch.device, steps: int = 2) -> float:
    """Host synchronisations per step: on CUDA those CUDA's sync-debug mode ("warn") reports, elsewhere those
    ``pyro_flat.testing.HostSyncCounter`` counts (its CPU proxy: scalar reads, host copies, data-dependent shapes)."""
    if device.type != "cuda":
        with HostSyncCounter(depth=0) as counter:
            for _ in range(steps):
                step()
        return counter.count / steps
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / steps


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def profile(step: Callable[[], None], device: torch.device, steps: int = 3) -> tuple[float, float | None]:
    """``(kernel launches per step, GPU busy fraction)`` from the profiler (kernel time / wall time); off CUDA the
    launches are the ATen operations that are not views (``step_ops.OpCounter``, the CPU proxy) and the busy fraction
    ``None``. The profiler runs on every device (CPU activity only off CUDA), so that a CPU run checks its use."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    cuda = device.type == "cuda"
    _sync(device)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall = time.perf_counter() - begin
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    if cuda:
        return launches / steps, min(1.0, busy_us / 1e6 / wall)
    with OpCounter() as ops:
        for _ in range(steps):
            step()
    return ops.launching / steps, None


def measure(name: str, step: Callable[[], None], setup: Setup, args: argparse.Namespace, units: int = 1,
            counted: bool = True) -> dict:
    """The row of one variant; per gradient step when a call makes ``units`` of them. ``counted=False``: no host
    syncs, launches or busy fraction off CUDA (their CPU proxies are dispatch modes, under which ``torch.compile``'d
    code does not run: a ``torch.compile``'d torch step)."""
    times = step_times(step, setup.device, args.warmup, args.steps)
    median = statistics.median(times) / units
    row = {"variant": name, "ms": median * 1e3, "images/s": setup.batch / median, "syncs": None, "launches": None,
           "busy": None}
    if counted or setup.device.type == "cuda":
        launches, busy = profile(step, setup.device, args.proxy_steps)
        row.update(syncs=host_syncs(step, setup.device, args.proxy_steps) / units, launches=launches / units,
                   busy=busy)
    return row


def variants(setup: Setup, args: argparse.Namespace) -> list[tuple[str, str, Callable[[], object], bool]]:
    """``(method, variant, make, validation)`` of the step table, in the order they are measured: what the goals need
    first (eager, then compiled: compilation is the long part), then ``--all-variants``'s."""
    methods = args.methods
    hand = [m for m in methods if m in HAND_WRITTEN]
    jit_options = {"backend": None} if args.smoke else None  # smoke: Pyro's captured graph, not compiled
    # the hand-written steps' and the plain step's torch.compile: CUDA graphs on CUDA as the Pyro steps have them;
    # smoke: traced by dynamo, run uncompiled
    torch_jit = {"backend": "eager"} if args.smoke else {"mode": "reduce-overhead"} if setup.device.type == "cuda" \
        else {}
    plain_jit = {"backend": "eager"} if args.smoke else {}
    rows: list[tuple[str, str, Callable[[], object], bool]] = [
        (PLAIN, PLAIN_SGD, lambda: PlainTorch(setup, False), False),
        (PLAIN, PLAIN_SAM, lambda: PlainTorch(setup, True), False),
    ]
    for m in methods:
        rows.append((m, PYRO, lambda m=m: PyroStep(setup, m, True, False), False))
        if m in hand:
            rows.append((m, TORCH, lambda m=m: torch_step(setup, m, True), False))
    if not args.no_compile:
        rows += [(m, PYRO_COMPILED, lambda m=m: PyroStep(setup, m, True, True, jit_options), False) for m in methods]
        rows += [(m, TORCH_COMPILED, lambda m=m: torch_step(setup, m, True, {**torch_jit, "fullgraph": True}), False)
                 for m in hand]
        rows += [(PLAIN, name + PLAIN_COMPILED, lambda sam=sam: PlainTorch(setup, sam, plain_jit), False)
                 for name, sam in ((PLAIN_SGD, False), (PLAIN_SAM, True))]
    if args.all_variants:
        for m in methods:
            rows.append((m, "Pyro per tensor", lambda m=m: PyroStep(setup, m, False, False), False))
            for packed in (True, False):
                rows.append((m, f"Pyro {'packed' if packed else 'per tensor'}, validation on",
                             lambda m=m, p=packed: PyroStep(setup, m, p, False), True))
            if m in hand:
                rows.append((m, "torch per tensor", lambda m=m: torch_step(setup, m, False), False))
    return rows


def release(step: object, device: torch.device, compiled: bool) -> None:
    """Free a measured variant before the next: its tensors, and after a compiled one torch.compile's caches and CUDA
    graph pools (the hand-written steps of one class share the code that dynamo caches, up to its recompile limit)."""
    del step
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_table(setup: Setup, args: argparse.Namespace, deadline: float) -> tuple[list[str], list[dict]]:
    """The table's lines and its rows; what the time budget leaves out is noted."""
    rows, notes = [], []
    for method, label, make, validation in variants(setup, args):
        if time.perf_counter() > deadline:
            notes.append(f"{method}: {label} skipped (time budget spent)")
            continue
        pyro.enable_validation(validation)
        step = None
        try:
            step = make()
            if label.startswith("torch"):
                difference = check(setup, method, "packed" in label, step)
                if not difference < 1e-2:  # bf16: the forward passes agree to about 1e-3
                    notes.append(f"{method}: {label} differs from the Pyro step by {difference:.2e}")
            counted = not (label.startswith("torch") and "compiled" in label or "torch.compile" in label)
            row = measure(label, getattr(step, "step", step), setup, args, getattr(step, "units", 1), counted)
        except Exception as error:  # noqa: BLE001 (a failing variant is reported, the check goes on)
            notes.append(f"{method}: {label} failed: {type(error).__name__}: {error}")
            continue
        finally:
            pyro.enable_validation(False)
            release(step, setup.device, compiled="compile" in label)
        row["method"] = method
        rows.append(row)
    if "Entropy-SGLD" in args.methods:
        notes.append(f"Entropy-SGLD: per gradient step (a transition is {INNER_STEPS} of them)")

    def fmt(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    cuda = setup.device.type == "cuda"
    order = [PLAIN, *args.methods]
    lines = ["| step | variant | ms / step | images / s | host syncs / step | "
             f"{'kernel launches' if cuda else 'ATen operations (CPU proxy of launches)'} / step | GPU busy |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: order.index(r["method"])):
        busy = "–" if r["busy"] is None else f"{100 * r['busy']:.0f} %"
        lines.append(f"| {r['method']} | {r['variant']} | {r['ms']:.2f} | {r['images/s']:.0f} | "
                     f"{fmt(r['syncs'], '.1f')} | {fmt(r['launches'], '.0f')} | {busy} |")
    return [*lines, "", *[f"- {n}" for n in notes], ""], rows


def goal_table(rows: list[dict]) -> list[str]:
    """Issue 27's goals that the step table measures, computed from its rows (``–``: a row is missing)."""
    by = {(r["method"], r["variant"]): r for r in rows}

    def ms(method: str, variant: str) -> float | None:
        row = by.get((method, variant))
        return None if row is None else row["ms"]

    goals: list[tuple[str, float | None, str, float | None]] = []  # (measure, value, goal, bound)

    def ratio(label: str, a: tuple[str, str], b: tuple[str, str], goal: str, bound: float | None) -> None:
        x, y = ms(*a), ms(*b)
        goals.append((label, None if x is None or y is None else x / y, goal, bound))

    for m, bound in (("MAP", 0.5), ("VI", 0.65)):
        ratio(f"compiled {m} step / plain torch eager SGD step", (m, PYRO_COMPILED), (PLAIN, PLAIN_SGD),
              f"≤ {bound}", bound)
    for m in ("SAM", "F-VI"):
        ratio(f"compiled {m} step / plain torch eager SAM step", (m, PYRO_COMPILED), (PLAIN, PLAIN_SAM), "≤ 0.45",
              0.45)
    ratio("compiled KL-ball step / compiled F-VI step", ("KL ball", PYRO_COMPILED), ("F-VI", PYRO_COMPILED), "≤ 1.2",
          1.2)
    for m in KERNELS:
        ratio(f"compiled {m} step / compiled MAP step", (m, PYRO_COMPILED), ("MAP", PYRO_COMPILED), "≤ 1.1", 1.1)
    for m in HAND_WRITTEN:
        ratio(f"eager packed {m} step / hand-written packed torch step", (m, PYRO), (m, TORCH), "≤ 1.2", 1.2)
    busy = by.get(("MAP", PYRO_COMPILED), {}).get("busy")
    goals.append(("GPU busy fraction of the compiled MAP step", busy, "≥ 70 %", None))
    for m in HAND_WRITTEN:
        ratio(f"compiled {m} step / compiled hand-written step (the limit)", (m, PYRO_COMPILED), (m, TORCH_COMPILED),
              "measured alongside", None)
    for name in (PLAIN_SGD, PLAIN_SAM):
        ratio(f"plain torch {name}: torch.compile(net) + fused SGD / eager", (PLAIN, name + PLAIN_COMPILED),
              (PLAIN, name), "measured alongside", None)
    lines = ["| measure | value | goal | met |", "|---|---|---|---|"]
    for label, value, goal, bound in goals:
        if label.startswith("GPU busy"):
            shown = "–" if value is None else f"{100 * value:.0f} %"
            met = "–" if value is None else "yes" if value >= 0.7 else "no"
        else:
            shown = "–" if value is None else f"{value:.2f}"
            met = "–" if value is None or bound is None else "yes" if value <= bound else "no"
        lines.append(f"| {label} | {shown} | {goal} | {met} |")
    return [*lines, ""]


def run_tests(args: argparse.Namespace, deadline: float) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *args.pytest_args]
    begin = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                timeout=max(60.0, deadline - begin))
    except subprocess.TimeoutExpired as error:
        return [f"`{' '.join(command[1:])}` did not finish in {error.timeout:.0f} s (the time budget)", ""]
    lines = (result.stdout + result.stderr).strip().splitlines()
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line or "error" in line),
                   lines[-1] if lines else "no output")
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return [f"`{' '.join(command[1:])}` (exit code {result.returncode}, {time.perf_counter() - begin:.0f} s): "
            f"{summary.strip('= ')}", "", *[f"- {line}" for line in failed[:40]], ""]


def run_harness(setup: Setup, args: argparse.Namespace, rows: list[dict], deadline: float) -> list[str]:
    """``bench --compile`` for 2 epochs of every harness method whose step is in the table; the second epoch's time
    against its steps x the compiled step (from ``rows``). Smoke: the first method only, eager."""
    from pyro_flat.data import write_synthetic_cifar

    methods = [h for h, m in HARNESS.items() if m in args.methods][: 1 if args.smoke else None]
    reference = PYRO if args.smoke else PYRO_COMPILED  # the step the harness runs
    step_ms = {r["method"]: r["ms"] for r in rows if r["variant"] == reference}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        write_synthetic_cifar(root, num_train=args.harness_images, num_test=min(256, args.harness_images))
        out = Path(tmp) / "out"
        command = [sys.executable, "-m", "pyro_flat", "bench", "--datasets", "cifar10", "--data-root", str(root),
                   "--model", "resnet18", "--width", str(args.width), "--device", str(setup.device), "--epochs", "2",
                   "--batch-size", str(setup.batch), "--methods", *methods, "--out", str(out), "--no-progress",
                   "--no-figures", "--lambda-max-iters", "2", "--lambda-max-points", "64", "--bma-samples", "2"]
        if not args.smoke:  # smoke: eager (the compiled harness is tests/bench/test_flat_seeking.py's)
            command += ["--compile"]
        if setup.precision == "bf16":
            command += ["--precision", "bf16"]
        if setup.channels_last:
            command += ["--channels-last"]
        # smoke: one thread (toy sizes; on a loaded machine more threads made an epoch 100 times slower)
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.smoke else None
        begin = time.perf_counter()
        shown = f"`python -m pyro_flat {' '.join(command[3:])}`"
        try:
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env,
                                    timeout=max(60.0, deadline - begin))
            status, failure = f"exit code {result.returncode}", result.returncode != 0
            output = result.stdout + result.stderr
        except subprocess.TimeoutExpired:  # the epochs done so far are in metrics.jsonl
            status, failure, output = "stopped at the time budget", False, ""
        lines = [f"{shown} ({status}, {time.perf_counter() - begin:.0f} s)", ""]
        if failure:
            lines += ["```", *output.strip().splitlines()[-30:], "```", ""]
        metrics = out / "metrics.jsonl"  # one line an epoch, written as the epoch ends
        entries = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.exists() else []
    lines += ["| job | epoch | steps | seconds | ms / step | the step alone (ms) | epoch / (steps x step) | goal |",
              "|---|---|---|---|---|---|---|---|"]
    previous: dict[str, int] = {}
    for e in entries:
        if "epoch" not in e or e.get("seconds") is None:
            continue
        steps = e["step"] - previous.get(e["job"], 0)
        previous[e["job"]] = e["step"]
        per_step = e["seconds"] / max(steps, 1) * 1e3
        alone = step_ms.get(HARNESS.get(e["job"].split("/")[1], ""))
        last = e["epoch"] >= 2  # the first epoch compiles
        ratio = f"{per_step / alone:.2f}" if alone and last else "–"
        lines.append(f"| {e['job']} {e.get('phase') or ''} | {e['epoch']} | {steps} | {e['seconds']:.2f} | "
                     f"{per_step:.1f} | {'–' if alone is None else f'{alone:.2f}'} | {ratio} | "
                     f"{'≤ 1.1' if last else '(compiles)'} |")
    return [*lines, "", f"The step alone is the table's `{reference}` row of the method (the harness's configuration "
            "may differ: its prior, guide and schedule are its own).", ""]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (a CPU check of the script)")
    parser.add_argument("--parts", nargs="+", default=["tests", "steps", "harness"],
                        choices=["tests", "steps", "harness"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--all-variants", action="store_true",
                        help="also the Pyro steps per tensor and with validation on, and the hand-written per tensor")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check (default 540)")
    parser.add_argument("--no-compile", action="store_true", help="no compiled variant in the step table")
    parser.add_argument("--pytest-args", nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    deadline = begin + args.budget
    device = torch.device(args.device)
    if args.smoke:
        torch.set_num_threads(1)  # toy sizes: more threads only contend on a loaded machine
        args.width, batch, num_data, precision, channels_last, image = 2, 4, 32, "float32", False, 8
        args.harness_images = 40
        args.warmup, args.steps, args.proxy_steps = 1, 1, 1
    else:
        args.width, batch, num_data, precision, channels_last, image = 64, 128, 1024, "bf16", device.type == "cuda", 32
        args.harness_images, args.proxy_steps = 10240, 3
    torch.set_default_dtype(torch.float32)
    pyro.set_rng_seed(0)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        torch.backends.cudnn.benchmark = True
    else:
        name = "cpu"
    tag = name.lower().replace("nvidia ", "").split()[0].replace("/", "-") if device.type == "cuda" else "cpu"
    out = args.out or Path(__file__).parent / "results" / f"gpu_{tag}.md"
    rows_file = out.with_suffix(".json")
    setup = Setup(device, args.width, batch, num_data, precision, channels_last, image)
    lines = ["# GPU check", "", f"{name}; torch {torch.__version__}, pyro {pyro.__version__}; ResNet-18 width "
             f"{args.width} ({setup.size / 1e6:.2f} M weights), batch {batch}, {precision}"
             f"{', channels-last' if channels_last else ''}; {args.warmup} warm-up and {args.steps} timed steps per "
             "variant (median).", ""]
    if "tests" in args.parts:
        lines += ["## CUDA tests", "", *run_tests(args, deadline)]
    rows: list[dict] = []
    if "steps" in args.parts:
        table, rows = step_table(setup, args, deadline)
        lines += ["## Steps", "", *table, "## Goals", "", *goal_table(rows)]
        out.parent.mkdir(parents=True, exist_ok=True)
        rows_file.write_text(json.dumps(rows, indent=1))
    elif rows_file.exists():
        rows = json.loads(rows_file.read_text())
    if "harness" in args.parts:
        if time.perf_counter() < deadline:
            lines += ["## Harness", "", *run_harness(setup, args, rows, deadline)]
        else:
            lines += ["## Harness", "", "skipped: the time budget was spent", ""]
    lines += [f"Total {time.perf_counter() - begin:.0f} s.", "", "Command:", "", "```bash",
              "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv), "```", ""]
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

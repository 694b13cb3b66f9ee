"""The GPU check: on a CUDA machine, one command runs the CUDA tests, the step table and the harness, and writes
``benchmarks/results/gpu_<device>.md``.

1. **Tests**: the CUDA-marked tests (``pytest -m cuda``) under the project's own pytest settings.
2. **Step table**: ResNet-18 (CIFAR stem, 11.2 M weights), batch 128, bf16 autocast, channels-last, random CIFAR-shaped
   data already on the device; for MAP, VI, SAM, F-VI, KL ball and SGLD: the Pyro step per tensor and packed, eager
   with Pyro's validation on and off, and compiled (packed, validation off: CUDA graphs), against the hand-written
   torch steps doing the same arithmetic (``_svi_steps.py``, ``step_ops.py``: per tensor and packed, validation off on
   both sides; each checked to compute the Pyro step's loss and gradients before it is timed). Per variant: the median
   step time over the timed steps (CUDA events), images per second, host synchronisations per step (CUDA's sync-debug
   mode at ``"warn"``, its warnings counted), and from the profiler, over a few steps, the kernel launches per step and
   the GPU busy fraction (kernel time / wall time).
3. **Harness**: ``bench`` for 2 epochs of ``map``, ``vi`` and ``sam`` on generated CIFAR-format data (10,240 images,
   augmentation on the device), its epoch time against steps x the step time alone.

It runs in under 8 minutes on one H100 or H200 (``--budget`` seconds, default 450: later parts are skipped with a note
when the budget is spent). On a machine without Pyro, carry the wheels of ``pyro-ppl`` and ``pyro-api`` (the device
tool's README) and put them on ``PYTHONPATH``; nothing else is needed beyond torch, torchvision, pytest, scikit-learn
and matplotlib.

Run: ``python benchmarks/gpu_check.py`` (on a GPU); ``python benchmarks/gpu_check.py --smoke --device cpu`` runs every
part at toy size on a CPU (what CI checks).
"""

from __future__ import annotations

import argparse
import contextlib
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
from _svi_steps import LR, TorchBBB, TorchMAP, check_same_step, packed_torch
from kl_ball_elbo import RADIUS, TorchKLBall
from pyro.infer.autoguide import AutoDelta, AutoNormal
from sharpness_aware_elbo import RHO, TorchBBBSAM
from step_ops import STEP_SIZE, TorchSGLDStep
from torch.func import functional_call

from pyro_flat.infer import (
    JitKLBallELBO,
    JitSharpnessAwareELBO,
    JitTensorTrace_ELBO,
    KLBallELBO,
    SharpnessAwareELBO,
    TensorSVI,
    TensorTrace_ELBO,
)
from pyro_flat.infer.mcmc import SGLD
from pyro_flat.nn import BayesianClassifier, init_to_network, make_bayesian, resnet18

ROOT = Path(__file__).resolve().parents[1]


class Setup:
    """The network and data of the step table."""

    def __init__(self, device: torch.device, width: int, batch: int, num_data: int, precision: str,
                 channels_last: bool, image: int = 32) -> None:
        self.device, self.batch, self.precision, self.channels_last = device, batch, precision, channels_last
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(num_data, 3, image, image, generator=generator).to(device)
        if channels_last:
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, 10, (num_data,), generator=generator).to(device)
        torch.manual_seed(0)
        self.net = resnet18(10, width=width).to(device)
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)
        self.names = [n for n, _ in self.net.named_parameters()]
        self.autocast = torch.bfloat16 if precision == "bf16" else None
        self.size = sum(p.numel() for p in self.net.parameters())

    def model(self, packed: bool) -> BayesianClassifier:
        import copy

        net = make_bayesian(copy.deepcopy(self.net), packed=packed)
        return BayesianClassifier(net, 10, autocast=self.autocast)

    def forward(self, weights, x):
        params = dict(zip(self.names, weights, strict=True))
        if self.autocast is None:
            return functional_call(self.net, params, (x,))
        with torch.autocast(x.device.type, dtype=self.autocast):
            return functional_call(self.net, params, (x,)).float()

    def torch_args(self, packed: bool):
        params = list(self.net.parameters())
        return packed_torch(params, self.forward) if packed else (params, self.forward)


class PyroStep:
    """A ``TensorSVI`` step (or an SG-MCMC transition) of one variant."""

    def __init__(self, setup: Setup, method: str, packed: bool, compiled: bool,
                 jit_options: dict | None = None) -> None:
        pyro.clear_param_store()
        self.setup, self.method = setup, method
        model = setup.model(packed)
        self.model = model
        if method == "SGLD":
            self.kernel = SGLD(model, step_size=STEP_SIZE, init_strategy=init_to_network(model),
                               divergence_check_every=10**9, jit_compile=compiled, jit_options=jit_options)
            self.kernel.setup(0, setup.x, setup.y, subsample_size=setup.batch)
            self.params = self.kernel.initial_params
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
        if self.method == "SGLD":
            self.params = self.kernel.sample(self.params)
        else:
            self.svi.step(self.setup.x, self.setup.y, subsample_size=self.setup.batch)

    def loss_and_grads(self):
        """For ``step_ops.check_same_step``: the loss and gradients in the hand-written step's order."""
        store = pyro.get_param_store()
        loss = self.loss.differentiable_loss(self.model, self.guide, self.setup.x, self.setup.y,
                                             subsample_size=self.setup.batch)
        names = list(store.keys())
        if not isinstance(self.guide, AutoDelta):
            names = [n for n in names if ".locs." in n] + [n for n in names if ".scales." in n]
        return loss.detach(), list(torch.autograd.grad(loss, [store._params[n] for n in names]))


HAND_WRITTEN = {"MAP": (TorchMAP, {}), "VI": (TorchBBB, {}), "SAM": (TorchMAP, {"rho": RHO}),
                "F-VI": (TorchBBBSAM, {}), "KL ball": (TorchKLBall, {}), "SGLD": (TorchSGLDStep, {})}


def torch_step(setup: Setup, method: str, packed: bool) -> Callable[[], None]:
    cls, options = HAND_WRITTEN[method]
    params, forward = setup.torch_args(packed)
    if cls is TorchSGLDStep:
        class _Net:  # what TorchSGLDStep reads of step_ops.Network
            x, y, batch = setup.x, setup.y, setup.batch
        return TorchSGLDStep(_Net, params, forward)
    return cls(setup.x, setup.y, params, forward, setup.batch, **options)


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


def host_syncs(step: Callable[[], None], device: torch.device, steps: int = 2) -> float | None:
    """Synchronisations per step seen by CUDA's sync-debug mode ("warn"); ``None`` off CUDA."""
    if device.type != "cuda":
        return None
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


def profile(step: Callable[[], None], device: torch.device, steps: int = 3) -> tuple[float | None, float | None]:
    """``(kernel launches per step, GPU busy fraction)`` from the profiler; ``(None, None)`` off CUDA."""
    if device.type != "cuda":
        return None, None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    _sync(device)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall = time.perf_counter() - begin
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                        "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    return launches / steps, min(1.0, busy_us / 1e6 / wall)


def measure(name: str, step: Callable[[], None], setup: Setup, args: argparse.Namespace) -> dict:
    times = step_times(step, setup.device, args.warmup, args.steps)
    median = statistics.median(times)
    launches, busy = profile(step, setup.device)
    return {"variant": name, "ms": median * 1e3, "images/s": setup.batch / median,
            "syncs": host_syncs(step, setup.device), "launches": launches, "busy": busy}


def step_table(setup: Setup, args: argparse.Namespace, deadline: float) -> list[str]:
    """Every eager and hand-written variant of every method first, then the compiled ones (their compilation is the
    long part: what the time budget leaves out is noted)."""
    variants: list[tuple[str, str, Callable[[], object], bool]] = []
    for method in args.methods:
        for packed in (False, True):
            form = "packed" if packed else "per tensor"
            for validation in (True, False):
                variants.append((method, f"Pyro {form}, validation {'on' if validation else 'off'}",
                                 lambda m=method, p=packed: PyroStep(setup, m, p, False), validation))
            variants.append((method, f"torch {form}", lambda m=method, p=packed: torch_step(setup, m, p), False))
    if not args.no_compile:
        jit_options = {"backend": None} if args.smoke else None  # smoke: the captured graph, not compiled
        for method in args.methods:
            variants.append((method, "Pyro packed, compiled",
                             lambda m=method: PyroStep(setup, m, True, True, jit_options), False))
    rows, notes = [], []
    for method, label, make, validation in variants:
        if time.perf_counter() > deadline:
            notes.append(f"{method}: {label} skipped (time budget spent)")
            continue
        pyro.enable_validation(validation)
        try:
            step = make()
            if label.startswith("torch") and method != "SGLD":
                pyro_step = PyroStep(setup, method, "packed" in label, False)
                difference = check_same_step(pyro_step, step)
                if not difference < 1e-2:  # bf16: the forward passes agree to about 1e-3
                    notes.append(f"{method}: {label} differs from the Pyro step by {difference:.2e}")
            row = measure(label, getattr(step, "step", step), setup, args)
        except Exception as error:  # noqa: BLE001 (a failing variant is reported, the check goes on)
            notes.append(f"{method}: {label} failed: {type(error).__name__}: {error}")
            continue
        finally:
            pyro.enable_validation(False)
        row["method"] = method
        rows.append(row)
    for method in args.methods:
        pyro_ms = [r["ms"] for r in rows if r["method"] == method and r["variant"].startswith("Pyro")
                   and "validation on" not in r["variant"]]
        torch_ms = [r["ms"] for r in rows if r["method"] == method and r["variant"].startswith("torch")]
        if pyro_ms and torch_ms:
            goal = 1.4 if method == "KL ball" else 1.2
            notes.append(f"{method}: best Pyro path / best hand-written = {min(pyro_ms) / min(torch_ms):.2f} "
                         f"(goal ≤ {goal})")

    def fmt(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    lines = ["| step | variant | ms / step | images / s | host syncs / step | kernel launches / step | GPU busy |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: args.methods.index(r["method"])):
        busy = "–" if r["busy"] is None else f"{100 * r['busy']:.0f} %"
        lines.append(f"| {r['method']} | {r['variant']} | {r['ms']:.2f} | {r['images/s']:.0f} | "
                     f"{fmt(r['syncs'], '.1f')} | {fmt(r['launches'], '.0f')} | {busy} |")
    return [*lines, "", *[f"- {n}" for n in notes], ""]


def run_tests(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *args.pytest_args]
    begin = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.test_timeout)
    lines = (result.stdout + result.stderr).strip().splitlines()
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line or "error" in line),
                   lines[-1] if lines else "no output")
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return [f"`{' '.join(command[1:])}` (exit code {result.returncode}, {time.perf_counter() - begin:.0f} s): "
            f"{summary.strip('= ')}", "", *[f"- {line}" for line in failed[:40]], ""]


def run_harness(setup: Setup, args: argparse.Namespace) -> list[str]:
    from pyro_flat.data import write_synthetic_cifar

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        write_synthetic_cifar(root, num_train=args.harness_images, num_test=min(256, args.harness_images))
        out = Path(tmp) / "out"
        command = [sys.executable, "-m", "pyro_flat", "bench", "--datasets", "cifar10", "--data-root", str(root),
                   "--model", "resnet18", "--width", str(args.width), "--device", str(setup.device), "--epochs", "2",
                   "--batch-size", str(setup.batch), "--methods", *args.harness_methods, "--out", str(out),
                   "--no-progress", "--lambda-max-iters", "2", "--lambda-max-points", "64", "--bma-samples", "2"]
        if setup.precision == "bf16":
            command += ["--precision", "bf16"]
        if setup.channels_last:
            command += ["--channels-last"]
        begin = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.harness_timeout)
        seconds = time.perf_counter() - begin
        lines = [f"`python -m pyro_flat {' '.join(command[3:])}` (exit code {result.returncode}, {seconds:.0f} s)", ""]
        if result.returncode != 0:
            return [*lines, "```", *(result.stdout + result.stderr).strip().splitlines()[-30:], "```", ""]
        import json

        entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        lines += ["| job | epoch | steps | seconds | seconds / step |", "|---|---|---|---|---|"]
        previous: dict[str, int] = {}
        for e in entries:
            if "epoch" not in e or e.get("seconds") is None:
                continue
            steps = e["step"] - previous.get(e["job"], 0)
            previous[e["job"]] = e["step"]
            lines.append(f"| {e['job']} {e.get('phase') or ''} | {e['epoch']} | {steps} | {e['seconds']:.2f} | "
                         f"{e['seconds'] / max(steps, 1) * 1e3:.1f} ms |")
        lines += ["", "Epoch time / (steps x the step time alone): compare the second epoch's ms per step with the "
                  "table's 'Pyro packed, validation off' row of the same method (fp32 or bf16 as run).", ""]
        return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (a CPU check of the script)")
    parser.add_argument("--methods", nargs="+", default=list(HAND_WRITTEN), choices=list(HAND_WRITTEN))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-harness", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--pytest-args", nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    deadline = begin + args.budget
    device = torch.device(args.device)
    if args.smoke:
        args.width, batch, num_data, precision, channels_last, image = 2, 4, 32, "float32", False, 8
        args.harness_images, args.harness_methods = 40, ["map"]
        args.warmup, args.steps = 1, 1
    else:
        args.width, batch, num_data, precision, channels_last, image = 64, 128, 1024, "bf16", device.type == "cuda", 32
        args.harness_images, args.harness_methods = 10240, ["map", "vi", "sam"]
    args.test_timeout, args.harness_timeout = 240, 240
    torch.set_default_dtype(torch.float32)
    pyro.set_rng_seed(0)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        torch.backends.cudnn.benchmark = True
    else:
        name = "cpu"
    tag = name.lower().replace("nvidia ", "").split()[0].replace("/", "-") if device.type == "cuda" else "cpu"
    out = args.out or Path(__file__).parent / "results" / f"gpu_{tag}.md"
    setup = Setup(device, args.width, batch, num_data, precision, channels_last, image)
    lines = ["# GPU check", "", f"{name}; torch {torch.__version__}, pyro {pyro.__version__}; ResNet-18 width "
             f"{args.width} ({setup.size / 1e6:.2f} M weights), batch {batch}, {precision}"
             f"{', channels-last' if channels_last else ''}; {args.warmup} warm-up and {args.steps} timed steps per "
             "variant (median).", ""]
    if not args.no_tests:
        lines += ["## CUDA tests", "", *run_tests(args)]
    lines += ["## Steps", "", *step_table(setup, args, deadline)]
    if not args.no_harness:
        if time.perf_counter() < deadline:
            lines += ["## Harness", "", *run_harness(setup, args)]
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

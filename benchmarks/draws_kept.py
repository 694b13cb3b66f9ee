"""The price of keeping every SG-MCMC draw: pyro_flat's SGLD kernel inside Pyro's ``MCMC`` / ``StreamingMCMC``
against a hand-written torch SGLD loop that stores its draws in a preallocated tensor.

The MLP 64-256-256-10 on digits of ``benchmarks/_svi_steps.py`` (N = 1257, minibatch 128, float32, one thread,
Pyro's validation off for every variant). One timed block is one run of ``--draws`` draws, every transition kept
(thinning 1), set-up included; the time is per gradient step. Variants, interleaved in every repeat (order
alternating), median over repeats:

* ``torch SGLD, draws in a preallocated tensor``: the idiomatic torch loop of ``benchmarks/compiled.py`` (``nn.Module``,
  ``F.cross_entropy``, in-place Langevin updates) copying its weights into row k of ``[draws, ...]`` tensors
  allocated before the loop: the reference;
* ``torch SGLD, no draw kept``: the same loop keeping nothing;
* ``StreamingMCMC(SGLD) + DrawBuffer``: ``DrawBuffer(draws).streaming_mcmc(kernel, draws, 0)``, i.e. Pyro's
  ``StreamingMCMC(kernel, hook_fn=buffer, statistics=StatsOfDict(default=CountStats), save_params=[])``: the draws
  in the buffer (pyro_flat's draw sink), none copied by Pyro's driver;
* ``MCMC(SGLD)``: Pyro's ``MCMC``, which keeps the draws itself (a list of flat copies, stacked at the end);
* ``SGLD.sample loop + DrawBuffer.add``: the kernel applied to its own output and each draw added to the buffer (what
  the harness's SG-MCMC methods do);

each Pyro variant compiled (``jit_compile=True``), and eager too with ``--eager``. Checked before timing: the
kernel's potential gradient equals the torch loop's at the same weights and seed; the buffer's draws equal
``MCMC.get_samples()`` of the same seed bit for bit; the torch loop's last row equals its final weights.

A second table isolates what keeping a draw costs from the gradient step: the same drivers around a kernel whose
``sample`` returns its parameters unchanged (the MLP's six weight tensors, 84 k floats), in microseconds per draw.

Run: ``python benchmarks/draws_kept.py``; writes ``benchmarks/results/draws_kept.md``.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pyro
import torch
from _report import write_markdown
from _svi_steps import Network
from _timing import environment, fresh_compile_cache, interleaved_times, medians_ms, timing_rows, warm_up
from compiled import STEP_SIZE, KernelSteps, TorchSGLD, check_same_gradient
from pyro.infer import MCMC
from pyro.infer.mcmc.api import StreamingMCMC
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.ops.streaming import CountStats, StatsOfDict

from pyro_flat.infer.mcmc import SGLD, DrawBuffer
from pyro_flat.nn import init_to_network

REFERENCE = "torch SGLD, draws in a preallocated tensor"


class TorchSGLDKeepingDraws(TorchSGLD):
    """The idiomatic torch SGLD loop, ``draws`` steps per ``step()``, each step's weights copied into its row of
    tensors allocated at the start of the run (``keep=False``: nothing kept)."""

    def __init__(self, network: Network, draws: int, keep: bool = True) -> None:
        super().__init__(network)
        self.draws, self.keep, self.units_per_step = draws, keep, draws
        self.rows: list[torch.Tensor] = []

    def step(self) -> None:
        if self.keep:
            self.rows = [p.new_empty((self.draws, *p.shape)) for p in self.params]
        for k in range(self.draws):
            self.update(self.gradients())
            if self.keep:
                with torch.no_grad():
                    for row, p in zip(self.rows, self.params, strict=True):
                        row[k].copy_(p)


class PyroRun:
    """One run of ``draws`` draws of the SGLD kernel per ``step()``: ``how`` is ``"streaming"`` (``StreamingMCMC`` +
    :class:`DrawBuffer`), ``"mcmc"`` (``MCMC`` keeps them) or ``"loop"`` (``SGLD.sample`` + ``DrawBuffer.add``)."""

    def __init__(self, network: Network, draws: int, how: str, **options: object) -> None:
        self.network, self.draws, self.how, self.units_per_step = network, draws, how, draws
        model = network.model()
        self.kernel = SGLD(model, step_size=STEP_SIZE, init_strategy=init_to_network(model), **options)
        self.params = None
        self.samples: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        net, kernel = self.network, self.kernel
        if self.how == "mcmc":
            mcmc = MCMC(kernel, num_samples=self.draws, warmup_steps=0, disable_progbar=True)
            mcmc.run(net.x, net.y, subsample_size=net.batch)
            self.samples = mcmc.get_samples()
            return
        buffer = DrawBuffer(self.draws)
        if self.how == "streaming":
            buffer.streaming_mcmc(kernel, self.draws, 0, disable_progbar=True).run(net.x, net.y,
                                                                                 subsample_size=net.batch)
        else:
            kernel.setup(0, net.x, net.y, subsample_size=net.batch)
            params = kernel.initial_params
            for _ in range(self.draws):
                params = kernel.sample(params)
                buffer.add(params)  # every site of this model is real: no transform to invert
            kernel.cleanup()
        self.samples = buffer.samples()


class IdleKernel(MCMCKernel):
    """A kernel that does nothing: ``sample`` returns the MLP's weights unchanged (what is left is the driver)."""

    model, transforms = None, {}

    def __init__(self, network: Network) -> None:
        self._params = {f"w{i}": p.detach().clone() for i, p in enumerate(network.torch_params)}

    def setup(self, warmup_steps: int, *args: object, **kwargs: object) -> None:
        """Nothing to set up: the chain starts at the network's weights."""

    @property
    def initial_params(self) -> dict[str, torch.Tensor]:
        return self._params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._params = params

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return params

    def logging(self) -> dict:
        return {}

    def diagnostics(self) -> dict:
        return {}


def driver_variants(network: Network, draws: int) -> dict[str, object]:
    """One run of ``draws`` draws of :class:`IdleKernel` per call, each way of keeping them (or none)."""
    weights = list(IdleKernel(network).initial_params.values())

    def torch_rows() -> None:
        rows = [w.new_empty((draws, *w.shape)) for w in weights]
        for k in range(draws):
            for row, w in zip(rows, weights, strict=True):
                row[k].copy_(w)

    def buffer_add() -> None:
        kernel, buffer = IdleKernel(network), DrawBuffer(draws)
        for _ in range(draws):
            buffer.add(kernel.sample(kernel.initial_params))

    def streaming_buffer() -> None:
        DrawBuffer(draws).streaming_mcmc(IdleKernel(network), draws, 0, disable_progbar=True).run()

    def streaming_nothing() -> None:
        StreamingMCMC(IdleKernel(network), draws, 0, disable_progbar=True, save_params=[],
                      statistics=StatsOfDict(default=CountStats)).run()

    def mcmc() -> None:
        MCMC(IdleKernel(network), draws, 0, disable_progbar=True).run()

    return {"torch loop, rows of a preallocated tensor": torch_rows, "loop + DrawBuffer.add": buffer_add,
            "DrawBuffer.streaming_mcmc (StreamingMCMC + DrawBuffer)": streaming_buffer,
            "StreamingMCMC keeping nothing (the driver alone)": streaming_nothing, "MCMC (Pyro keeps them)": mcmc}


def check_same_draws(network: Network, draws: int, seed: int = 3) -> str:
    """Whether the buffer's draws (``StreamingMCMC`` and the ``SGLD.sample`` loop) equal ``MCMC.get_samples()`` from
    the same seed, bit for bit."""
    results = {}
    for how in ("mcmc", "streaming", "loop"):
        pyro.set_rng_seed(seed)
        run = PyroRun(network, draws, how)
        run.step()
        results[how] = run.samples
    reference = results["mcmc"]
    same = all(torch.equal(results[how][name], reference[name]) for how in ("streaming", "loop") for name in reference)
    shapes = {tuple(v.shape[:1]) for v in reference.values()}
    return f"{'equal' if same else 'DIFFERENT'} ({len(reference)} sites, {shapes.pop()[0]} draws each)"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=1, help="runs per timed block")
    parser.add_argument("--draws", type=int, default=500, help="draws (= gradient steps) per run")
    parser.add_argument("--eager", action="store_true", help="time the Pyro variants eager as well")
    parser.add_argument("--jit-backend", default="inductor",
                        help="torch.compile backend of the compiled variants ('none': the captured graphs, uncompiled)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (capture and compilation)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "draws_kept.md")
    args = parser.parse_args(argv)
    fresh_compile_cache()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    pyro.set_rng_seed(0)
    warnings.filterwarnings("ignore", category=FutureWarning)
    network = Network("mlp")
    draws = args.draws
    jit = {"backend": None if args.jit_backend == "none" else args.jit_backend}
    variants = {
        REFERENCE: TorchSGLDKeepingDraws(network, draws),
        "torch SGLD, no draw kept": TorchSGLDKeepingDraws(network, draws, keep=False),
    }
    for label, how in (("StreamingMCMC(SGLD) + DrawBuffer", "streaming"), ("MCMC(SGLD)", "mcmc"),
                       ("SGLD.sample loop + DrawBuffer.add", "loop")):
        if args.eager:
            variants[label] = PyroRun(network, draws, how)
        variants[f"{label}, jit_compile=True"] = PyroRun(network, draws, how, jit_compile=True, jit_options=jit)
    checks = {
        "potential gradient, kernel vs torch loop (relative difference)":
            f"{check_same_gradient(KernelSteps(network, 0), variants[REFERENCE]):.1e}",
        "draws in the buffer vs MCMC.get_samples(), same seed": check_same_draws(network, 5),
    }
    torch_run = variants[REFERENCE]
    torch_run.step()
    checks["torch loop: last row = final weights"] = str(all(
        torch.equal(row[-1], p) for row, p in zip(torch_run.rows, torch_run.params, strict=True)))
    warmup = warm_up(variants, args.warmup)
    times = interleaved_times(variants, args.repeats, args.steps)
    med = medians_ms(times)
    low = {name: min(t) for name, t in times.items()}

    def ratios(name: str) -> str:
        if name not in times:
            return "– | –"
        return f"{med[name] / med[REFERENCE]:.2f} | {low[name] / low[REFERENCE]:.2f}"

    lines = [
        "# Keeping every SG-MCMC draw: Pyro's MCMC with a draw buffer against a torch loop",
        "",
        f"{network.describe}, SGLD step {STEP_SIZE}, every transition kept; one run of {draws} draws per timed block, "
        f"set-up included; {args.repeats} repeats, variants interleaved (order alternating); time per gradient step, "
        f"as the ratio of the medians and, less sensitive to the other jobs of a shared machine, of the fastest "
        f"repeats; {args.warmup} untimed run(s) first (compilation). Pyro's validation off. {environment()}",
        "",
        f"Against `{REFERENCE}`:",
        "",
        "| variant | eager, medians | eager, fastest | compiled, medians | compiled, fastest | goal |",
        "|---|---|---|---|---|---|",
    ]
    for label, goal in (("StreamingMCMC(SGLD) + DrawBuffer", "≤ 1.1"), ("MCMC(SGLD)", "(Pyro keeps the draws)"),
                        ("SGLD.sample loop + DrawBuffer.add", "(the harness's loop)")):
        lines.append(f"| {label} | {ratios(label)} | {ratios(label + ', jit_compile=True')} | {goal} |")
    lines.append(f"| torch SGLD, no draw kept | {ratios('torch SGLD, no draw kept')} | | | |")
    idle = driver_variants(network, draws)
    idle_times = interleaved_times(idle, args.repeats, 1, warmup=1)
    idle_med = medians_ms(idle_times)
    lines += ["", f"What keeping a draw costs, around a kernel that does nothing ({draws} draws per run, "
              f"{args.repeats} repeats interleaved; microseconds per draw):", "",
              "| driver | median | fastest |", "|---|---|---|"]
    lines += [f"| {name} | {idle_med[name] * 1e3 / draws:.0f} | {min(t) * 1e6 / draws:.0f} |"
              for name, t in idle_times.items()]
    lines += ["", "Checked before timing:", "", *[f"- {name}: {value}" for name, value in checks.items()], "",
              *timing_rows(times), "", "| variant | warm-up (s) |", "|---|---|"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in warmup.items()]
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()

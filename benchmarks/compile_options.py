"""Ways to evaluate a Pyro model's potential and its gradient without re-tracing it: what the compiled paths were
chosen from.

The potential U(z) of the Bayesian MLP 64-256-256-10 on digits (minibatch 128 drawn in the model, float32, one
thread, validation off) and its gradient, evaluated

* eagerly: Pyro re-runs the model at every call (``ModelPotential``), autograd for the gradient;
* as the captured graph (``pyro_flat.infer.compiled.capture``: the model run recorded once as ATen operations, the
  minibatch indices drawn outside) replayed in Python, autograd for the gradient — a functional potential;
* as that graph traced by ``torch.jit.trace`` (TorchScript's graph executor), autograd for the gradient;
* as that graph compiled by ``torch.compile`` (TorchInductor), autograd (AOTAutograd) for the gradient;
* as the potential *and* its gradient captured as one graph and compiled (what ``jit_compile=True`` runs).

Every variant timed in every repeat (order alternating), median; the set-up time (capture, tracing, compilation) of
each beside it. Run: ``python benchmarks/compile_options.py`` (writes ``benchmarks/results/compile_options.md``).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import pyro
import torch
from _report import write_markdown
from _svi_steps import BATCH, mlp_model
from _timing import environment, fresh_compile_cache, interleaved_times, medians_ms

from pyro_flat.data import load_digits
from pyro_flat.infer.compiled import capture
from pyro_flat.infer.mcmc import initialize_sg_model
from pyro_flat.nn import init_to_network


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--warm-cache", action="store_true", help="use TorchInductor's on-disk cache (default: cold)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compile_options.md")
    args = parser.parse_args(argv)
    if not args.warm_cache:
        fresh_compile_cache()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)
    pyro.set_rng_seed(0)
    data = load_digits(dtype=torch.float32)
    model = mlp_model()
    params, potential, _ = initialize_sg_model(model, (data.x_train, data.y_train), {"subsample_size": BATCH},
                                               init_to_network(model))
    names = list(params)
    values = [params[n] for n in names]

    def leaves():
        return [v.detach().requires_grad_() for v in values]

    def eager():
        z = leaves()
        torch.autograd.grad(potential(dict(zip(names, z, strict=True))), z)

    setup = {}
    start = time.perf_counter()
    _, forward = capture(lambda: potential(dict(zip(names, values, strict=True))), lambda: values)
    setup["captured graph + autograd"] = time.perf_counter() - start

    def graph_step(run):
        def step():
            z = leaves()
            torch.autograd.grad(run(*z, *forward.draw()), z)
        return step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated (FutureWarning)
        start = time.perf_counter()
        traced = torch.jit.trace(forward.graph, (*values, *forward.draw()), check_trace=False)
        setup["graph + torch.jit.trace + autograd"] = time.perf_counter() - start
    compiled = torch.compile(forward.graph, fullgraph=True, dynamic=False, backend=args.backend)

    def gradient():
        z = {n: v.detach().requires_grad_() for n, v in zip(names, values, strict=True)}
        with torch.enable_grad():
            u = potential(z)
            grads = torch.autograd.grad(u, list(z.values()))
        return u.detach(), list(grads)

    _, both = capture(gradient, lambda: values)
    both.compile({"backend": args.backend})
    variants = {
        "eager Pyro model run + autograd": eager,
        "captured graph + autograd": graph_step(forward.graph),
        "graph + torch.jit.trace + autograd": graph_step(traced),
        "graph + torch.compile + autograd": graph_step(compiled),
        "potential and gradient as one graph + torch.compile": lambda: both(values),
    }
    for name in ("graph + torch.compile + autograd", "potential and gradient as one graph + torch.compile"):
        start = time.perf_counter()
        variants[name]()  # compiles
        setup[name] = time.perf_counter() - start
    times = medians_ms(interleaved_times(variants, args.repeats, args.steps, warmup=3))
    lines = [
        "# Evaluating a potential and its gradient: eager, captured graph, TorchScript, torch.compile",
        "",
        f"Bayesian MLP 64-256-256-10 on digits, minibatch {BATCH} drawn in the model, float32, validation off; "
        f"{args.repeats} interleaved repeats x {args.steps} gradient evaluations, median; torch.compile backend "
        f"`{args.backend}`, {'warm' if args.warm_cache else 'fresh (cold)'} TorchInductor cache. {environment()}",
        "",
        "| evaluation | ms per gradient | set-up (s) |",
        "|---|---|---|",
    ]
    for name, ms in times.items():
        lines.append(f"| {name} | {ms:.2f} | {setup.get(name, 0.0):.2f} |")
    return write_markdown(lines, args.out, __file__, argv)


if __name__ == "__main__":
    main()

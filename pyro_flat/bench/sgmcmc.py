r"""Stochastic-gradient MCMC methods of the comparison harness: SGLD, cyclical SGLD and Entropy-MCMC.

Every method runs the kernels of :mod:`pyro_flat.infer.mcmc` through Pyro's own ``MCMC`` on the run's model, with
minibatches of ``config.batch_size`` drawn inside the model, a budget of ``problem.num_steps`` gradient evaluations
(the epochs of the preset) and ``config.num_bma_samples`` draws averaged for prediction. The weights start at the
network's torch initialisation (:class:`~pyro_flat.nn.init_to_network`).

Hyperparameters (``--set METHOD.KEY=VALUE``), on the scale of the papers' mean-loss learning rate :math:`\alpha`:
the kernels' step size is :math:`\varepsilon = \alpha/N` (:mod:`pyro_flat.ops.diffusions`), so ``lr`` reads like an
SGD learning rate.

* ``sgld``: constant :math:`\alpha` = ``lr`` (default 0.3), temperature ``temperature`` (default 0.1, a mildly cold
  posterior; the Entropy-MCMC experiments use :math:`10^{-4}` on CIFAR); the first ``burn_in`` (default 0.5) of the
  budget is warm-up, then the draws are evenly thinned [3].
* ``csgld``: cyclical cosine :math:`\alpha` from ``lr`` to 0 over ``cycles`` (default 4) cycles, noise only in the last
  ``1 - exploration`` (default 0.2) of each cycle, ``ceil(S / cycles)`` draws at the end of each cycle [2].
* ``emcmc``: Entropy-MCMC [1] with the *same* step size, temperature, burn-in and budget as ``sgld`` plus ``eta``
  (default 0.01, the coupling variance on the full-data scale, the paper's :math:`\eta`); ``collect`` (default
  ``"both"``, as the authors average both networks) chooses the draws: half are :math:`\theta`, half
  :math:`\theta_a`.
* ``f_sgld``: F-SGLD [4]: ``sgld`` (same defaults for ``lr``, ``temperature``, ``burn_in``; same budget and thinning) on
  :func:`~pyro_flat.transforms.sharpness_aware` of the model with radius ``rho`` (default 0.05, the flat-seeking
  methods' default), i.e. Langevin dynamics on :math:`U_{\mathrm{SA}}(\theta)=-\log p(\theta)
  -\ell_B(\theta+\rho\hat g/\|\hat g\|)`. Unlike the authors' code (ALGORITHMS.md §1: SAM fine-tuning from a
  checkpoint with negligible noise) the noise is the full Langevin noise at ``temperature``, so it compares with
  ``sgld`` like with like. Each step costs two forward/backward passes.

The defaults were chosen on the MLP 256-256 of the ``full`` preset with seed 0 (so with a mild selection bias on the
test sets): ``lr`` in {0.1, 0.3} and ``temperature`` in {0.01, 0.1, 1} for ``sgld`` (0.3 and 0.1 gave the best NLL on
digits and a good one on MNIST-1D), then ``eta`` in {0.001, 0.01, 0.1} for ``emcmc`` at those values (0.1 is clearly
worse; 0.001 and 0.01 are close). ``csgld`` reuses ``sgld``'s values untuned.

References:
    [1] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    [2] `Cyclical Stochastic Gradient MCMC for Bayesian Deep Learning`, Ruqi Zhang, Chunyuan Li, Jianyi Zhang,
        Changyou Chen, Andrew Gordon Wilson (ICLR 2020), arXiv:1902.03932
    [3] `Bayesian Learning via Stochastic Gradient Langevin Dynamics`, Max Welling, Yee Whye Teh (ICML 2011)
    [4] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
        Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

import math

from pyro.infer import MCMC

from ..infer.mcmc import SGLD, CyclicalStepSize, EntropyMCMC, StochasticGradientKernel
from ..nn import init_to_network
from ..transforms import local_entropy_draws, sharpness_aware
from .problem import Posterior, Problem
from .registry import register_method

__all__ = ["run_sgmcmc", "fit_sgld", "fit_f_sgld", "fit_csgld", "fit_emcmc"]

REFERENCE_EMCMC = "Li & Zhang, Entropy-MCMC: Sampling from Flat Basins with Ease (ICLR 2024), arXiv:2310.05401"


def run_sgmcmc(problem: Problem, kernel: StochasticGradientKernel, num_samples: int, warmup_steps: int) -> dict:
    """Run ``kernel`` through ``pyro.infer.MCMC`` on the run's training data (minibatches drawn in the model).

    :param problem: the harness problem (data, batch size).
    :param kernel: a stochastic-gradient kernel built on the problem's model.
    :param int num_samples: the draws to keep.
    :param int warmup_steps: the warm-up transitions.
    :returns: the samples ``{site: [num_samples, ...]}`` in constrained space.
    """
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    args, kwargs = problem.train_args()
    mcmc.run(*args, **kwargs)
    return mcmc.get_samples()


def _constant_plan(problem: Problem, method: str, draws: int) -> tuple[int, int]:
    """``(warmup_steps, thinning)`` for a constant step size: burn-in, then ``draws`` evenly thinned draws."""
    budget = problem.num_steps
    burn_in = float(problem.option(method, "burn_in", 0.5))
    if not 0 <= burn_in < 1:
        raise ValueError(f"{method}.burn_in must be in [0, 1), got {burn_in!r}")
    warmup = int(burn_in * budget)
    thinning = max(1, (budget - warmup) // draws)
    return budget - thinning * draws, thinning


def _constant_sgld(problem: Problem, method: str, rho: float | None) -> Posterior:
    """SGLD with ``sgld``'s constant-step plan on the run's model, or on its sharpness-aware transform if ``rho``."""
    model = problem.build_model()
    target = model if rho is None else sharpness_aware(model, rho)
    lr = float(problem.option(method, "lr", 0.3))
    draws = problem.config.num_bma_samples
    warmup, thinning = _constant_plan(problem, method, draws)
    temperature = float(problem.option(method, "temperature", 0.1))
    kernel = SGLD(target, step_size=lr / problem.data.num_data, temperature=temperature,
                  init_strategy=init_to_network(model), thinning=thinning, jit_compile=problem.config.compile)
    samples = run_sgmcmc(problem, kernel, draws, warmup)
    info = {"warmup_steps": warmup, "thinning": thinning} | ({} if rho is None else {"rho": rho})
    return Posterior.from_samples(model, samples, draws, info=info)


@register_method(
    "sgld",
    description="SGLD (Welling & Teh 2011) through pyro.infer.MCMC, constant step, cold posterior",
    reference="Welling & Teh, Bayesian Learning via Stochastic Gradient Langevin Dynamics (ICML 2011)",
)
def fit_sgld(problem: Problem) -> Posterior:
    return _constant_sgld(problem, "sgld", None)


@register_method(
    "f_sgld",
    description="F-SGLD: SGLD on sharpness_aware(model, rho) (rho 0.05), same schedule as sgld",
    baseline="sgld",
    reference="Nguyen et al., Flat Seeking Bayesian Neural Networks (NeurIPS 2023), arXiv:2302.02713",
)
def fit_f_sgld(problem: Problem) -> Posterior:
    return _constant_sgld(problem, "f_sgld", float(problem.option("f_sgld", "rho", 0.05)))


@register_method(
    "csgld",
    description="cyclical SGLD (cSGLD): cosine step-size cycles, draws at the end of each cycle",
    baseline="sgld",
    reference="Zhang et al., Cyclical Stochastic Gradient MCMC for Bayesian Deep Learning (ICLR 2020), "
    "arXiv:1902.03932",
)
def fit_csgld(problem: Problem) -> Posterior:
    model = problem.build_model()
    lr = float(problem.option("csgld", "lr", 0.3))
    cycles = int(problem.option("csgld", "cycles", 4))
    draws = problem.config.num_bma_samples
    per_cycle = math.ceil(draws / cycles)
    cycle_length = problem.num_steps // cycles
    schedule = CyclicalStepSize(
        lr / problem.data.num_data,
        cycle_length,
        exploration_fraction=float(problem.option("csgld", "exploration", 0.8)),
        samples_per_cycle=per_cycle,
    )
    kernel = SGLD(model, step_size=schedule, temperature=float(problem.option("csgld", "temperature", 0.1)),
                  init_strategy=init_to_network(model), jit_compile=problem.config.compile)
    samples = run_sgmcmc(problem, kernel, cycles * per_cycle, 0)
    return Posterior.from_samples(model, samples, draws, info={"cycle_length": cycle_length, "cycles": cycles})


@register_method(
    "emcmc",
    description="Entropy-MCMC: SGLD on local_entropy(model, eta), theta and theta_a drawn (same schedule as sgld)",
    baseline="sgld",
    reference=REFERENCE_EMCMC,
)
def fit_emcmc(problem: Problem) -> Posterior:
    model = problem.build_model()
    lr = float(problem.option("emcmc", "lr", 0.3))
    collect = problem.option("emcmc", "collect", "both")
    draws = problem.config.num_bma_samples
    kept = math.ceil(draws / 2) if collect == "both" else draws
    warmup, thinning = _constant_plan(problem, "emcmc", kept)
    kernel = EntropyMCMC(
        model,
        eta=float(problem.option("emcmc", "eta", 0.01)),
        step_size=lr / problem.data.num_data,
        temperature=float(problem.option("emcmc", "temperature", 0.1)),
        collect=collect,
        init_strategy=init_to_network(model),
        thinning=thinning,
        jit_compile=problem.config.compile,
    )
    samples = local_entropy_draws(run_sgmcmc(problem, kernel, kept, warmup), collect)
    return Posterior.from_samples(model, samples, draws, info={"warmup_steps": warmup, "thinning": thinning})

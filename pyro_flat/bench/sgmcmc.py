r"""Stochastic-gradient MCMC methods of the comparison harness: SGLD, cyclical SGLD and Entropy-MCMC.

Every method runs the kernels of :mod:`pyro_flat.infer.mcmc` the way Pyro's own ``MCMC`` drives them
(:func:`run_sgmcmc`: ``setup``, then ``sample``; the same draws, plus checkpoints) on the run's model, with
minibatches of ``config.batch_size`` drawn inside the model (or from a ``DataLoader`` of augmented images), a budget
of ``problem.num_steps`` gradient evaluations (the epochs of the preset) and ``config.num_bma_samples`` draws
averaged for prediction. The weights start at the network's torch initialisation
(:class:`~pyro_flat.nn.init_to_network`).

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
  :math:`\theta_a`. With ``cycles`` it follows the authors' CIFAR schedule instead: ``csgld``'s cyclical cosine
  (``exploration`` default 0: noise at every step) with the draws at the end of each cycle; ``anchor_prior_scale``
  puts their weight decay on :math:`\theta_a` (:math:`(N\,\mathrm{wd})^{-1/2}`).
* ``f_sgld``: F-SGLD [4]: ``sgld`` (same defaults for ``lr``, ``temperature``, ``burn_in``; same budget and thinning) on
  :func:`~pyro_flat.transforms.sharpness_aware` of the model with radius ``rho`` (default 0.05, the flat-seeking
  methods' default), i.e. Langevin dynamics on :math:`U_{\mathrm{SA}}(\theta)=-\log p(\theta)
  -\ell_B(\theta+\rho\hat g/\|\hat g\|)`. Unlike the authors' code (SAM fine-tuning from a
  checkpoint with negligible noise) the noise is the full Langevin noise at ``temperature``, so it compares with
  ``sgld`` like with like. Each step costs two forward/backward passes; with ``looksam_k`` / ``looksam_alpha``
  (LookSAM) or ``rst_p`` (RST) only some do (:mod:`pyro_flat.ops.efficient_sam`).

The defaults were chosen on the MLP 256-256 of the ``full`` preset with seed 0 (so with a mild selection bias on the
test sets): ``lr`` in {0.1, 0.3} and ``temperature`` in {0.01, 0.1, 1} for ``sgld`` (0.3 and 0.1 gave the best NLL on
digits and a good one on MNIST-1D), then ``eta`` in {0.001, 0.01, 0.1} for ``emcmc`` at those values (0.1 is clearly
worse; 0.001 and 0.01 are close). ``csgld`` reuses ``sgld``'s values untuned.

References:
    * [1] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    * [2] `Cyclical Stochastic Gradient MCMC for Bayesian Deep Learning`, Ruqi Zhang, Chunyuan Li, Jianyi Zhang,
      Changyou Chen, Andrew Gordon Wilson (ICLR 2020), arXiv:1902.03932
    * [3] `Bayesian Learning via Stochastic Gradient Langevin Dynamics`, Max Welling, Yee Whye Teh (ICML 2011)
    * [4] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from ..infer.mcmc import SGLD, DrawBuffer, EntropyMCMC, StochasticGradientKernel
from ..nn import init_to_network
from ..transforms import local_entropy_draws, sharpness_aware
from .flat_seeking import cheaper_step_options
from .problem import Posterior, Problem
from .registry import register_method
from .schedules import CyclicalStepSize
from .state import Holder

__all__ = ["run_sgmcmc", "fit_sgld", "fit_f_sgld", "fit_csgld", "fit_emcmc"]

REFERENCE_EMCMC = "Li & Zhang, Entropy-MCMC: Sampling from Flat Basins with Ease (ICLR 2024), arXiv:2310.05401"


def run_sgmcmc(
    problem: Problem, kernel: StochasticGradientKernel, num_samples: int, warmup_steps: int, *, model: nn.Module,
    state: dict[str, object] | None = None,
) -> dict[str, Tensor]:
    """Run ``kernel`` as ``pyro.infer.MCMC(kernel, num_samples, warmup_steps)`` does — ``setup``, then ``sample``
    with the chain's parameters — as one checkpointed phase of single transitions, each on the next minibatch.

    The draws are the states ``MCMC`` keeps: after ``warmup_steps`` transitions every ``kernel.thinning``-th, or the
    collection steps of a cyclical schedule. On tensor data the model draws its minibatches (``MCMC.run`` with the
    full data and ``subsample_size``; the draws equal ``MCMC``'s bit for bit); on augmented images each transition
    gets the next ``DataLoader`` batch through :meth:`~pyro_flat.infer.mcmc.StochasticGradientKernel.set_model_args`.

    :param problem: the harness problem (data, batch size).
    :param kernel: a stochastic-gradient kernel built on the problem's model.
    :param int num_samples: the draws to keep.
    :param int warmup_steps: the warm-up transitions.
    :param model: the network (checkpointed with the chain: its BatchNorm statistics, learned weights).
    :param state: further objects the transitions change (e.g. the schedule of a sharpness-aware model's LookSAM or
        RST), checkpointed with the chain.
    :returns: the samples ``{site: [num_samples, ...]}`` in constrained space, kept in a
        :class:`~pyro_flat.infer.mcmc.DrawBuffer` (one copy per draw; in files under the run's checkpoint folder when
        it has one, so that a checkpoint holds only their number).
    """
    _check_one_chain(problem, model)
    draw_steps = _draw_steps(kernel, num_samples, warmup_steps)
    num_steps = draw_steps[-1] + 1
    args, kwargs = problem.setup_args()
    kernel.setup(num_steps, *args, **kwargs)  # every sample() call is then one transition
    if isinstance(kernel, EntropyMCMC):  # its warm-up (anchors drawn from their conditional) is the real one
        kernel.anchor_warmup_steps = warmup_steps
    chain = Holder(kernel.initial_params)
    names = kernel.save_params
    ctx = problem.context
    directory = ctx.directory / "draws" if ctx.directory is not None and ctx.is_writer else None
    draws = DrawBuffer(num_samples, sites=names, directory=directory)  # rows allocated once, files if checkpointed
    objects = {"model": model, "kernel": kernel, "chain": chain, "draws": draws, **(state or {})}
    loop = problem.loop(num_steps, objects, name="kernel")
    is_draw = set(draw_steps)
    for step, (args, kwargs) in loop:
        kernel.set_model_args(*args, **kwargs)
        chain.value = kernel.sample(chain.value)
        if step in is_draw:
            draws(kernel, chain.value, "Sample", step)  # MCMC's hook: constrained values into the next row
    kernel.diagnostics()  # raises if the chain diverged since the last check
    kernel.cleanup()
    return {name: value.to(problem.data.device) for name, value in draws.samples().items()}


def _check_one_chain(problem: Problem, model: nn.Module) -> None:
    """Refuse what a chain of :func:`run_sgmcmc` cannot run: data parallelism, a network with learned weights."""
    if problem.distributed:
        raise ValueError("the SG-MCMC methods run in one process: their kernels do not all-reduce gradients "
                         "(run them without torchrun)")
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("the network has learned (non-latent) weights, which an MCMC kernel does not train: with "
                         "latent='norm_and_head' or 'head' from scratch they would stay at their initialisation. Use "
                         "latent='all', or a pretrained network whose other weights are frozen")


def _csgld_schedule(problem: Problem) -> CyclicalStepSize:
    """``csgld``'s cyclical cosine step size: ``ceil(S / cycles)`` draws at the end of each of ``cycles`` cycles."""
    cycles = int(problem.option("csgld", "cycles", 4))
    return CyclicalStepSize(
        problem.full_data_lr(float(problem.option("csgld", "lr", 0.3))),
        problem.num_steps // cycles,
        exploration_fraction=float(problem.option("csgld", "exploration", 0.8)),
        samples_per_cycle=math.ceil(problem.config.num_bma_samples / cycles),
    )


def _emcmc_kept(problem: Problem) -> int:
    """The draws ``emcmc`` keeps: half of the BMA's of each network with ``collect="both"``."""
    draws = problem.config.num_bma_samples
    return math.ceil(draws / 2) if problem.option("emcmc", "collect", "both") == "both" else draws


def _emcmc_schedule(problem: Problem) -> CyclicalStepSize | None:
    """``emcmc``'s cyclical cosine step size with ``cycles`` (the authors' CIFAR schedule), else ``None``."""
    cycles = problem.option("emcmc", "cycles", None)
    if cycles is None:
        return None
    return CyclicalStepSize(problem.full_data_lr(float(problem.option("emcmc", "lr", 0.3))),
                            problem.num_steps // int(cycles),
                            exploration_fraction=float(problem.option("emcmc", "exploration", 0.0)),
                            samples_per_cycle=math.ceil(_emcmc_kept(problem) / int(cycles)))


def _check(problem: Problem, method: str) -> None:
    """The up-front check of an SG-MCMC method (:class:`~pyro_flat.bench.registry.MethodSpec`): what
    :func:`run_sgmcmc` refuses, and a cyclical step size whose cycles cannot hold their draws."""
    try:
        _check_one_chain(problem, problem.build_model())
    except ValueError as error:
        raise ValueError(f"{method}: {error}") from None
    try:
        if method == "csgld":
            _csgld_schedule(problem)
        elif method == "emcmc":
            _emcmc_schedule(problem)
    except ValueError as error:
        raise ValueError(f"{method}: {error} with {problem.num_steps} steps; run more steps (--epochs, a smaller "
                         f"--batch-size) or fewer cycles (--set {method}.cycles=K)") from None


def _draw_steps(kernel: StochasticGradientKernel, num_samples: int, warmup_steps: int) -> list[int]:
    """The transitions (0-based) after which ``MCMC`` would keep a draw."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    steps, t = [], warmup_steps
    if kernel.schedule.collects(0) is None:
        return [warmup_steps + (k + 1) * kernel.thinning - 1 for k in range(num_samples)]
    while len(steps) < num_samples:  # MCMC's call k runs until a collection step
        if kernel.schedule.collects(t):
            steps.append(t)
        t += 1
        if t > warmup_steps + 10**7:
            raise ValueError(f"the schedule {kernel.schedule!r} collected {len(steps)} of {num_samples} draws in "
                             "10^7 steps")
    return steps


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
    """SGLD with ``sgld``'s constant-step plan on the run's model, or on its sharpness-aware transform if ``rho``
    (with the method's LookSAM or RST options)."""
    model = problem.build_model()
    target = model if rho is None else sharpness_aware(model, rho, **cheaper_step_options(problem, method))
    state = {"schedule": target.schedule} if rho is not None and target.schedule.active else {}
    lr = float(problem.option(method, "lr", 0.3))
    draws = problem.config.num_bma_samples
    warmup, thinning = _constant_plan(problem, method, draws)
    temperature = float(problem.option(method, "temperature", 0.1))
    kernel = SGLD(target, step_size=problem.full_data_lr(lr), temperature=temperature,
                  init_strategy=init_to_network(model), thinning=thinning, jit_compile=problem.compiled)
    samples = run_sgmcmc(problem, kernel, draws, warmup, model=model, state=state)
    info = {"warmup_steps": warmup, "thinning": thinning} | ({} if rho is None else {"rho": rho})
    return Posterior.from_samples(model, samples, draws, info=info)


@register_method(
    "sgld",
    description="SGLD (Welling & Teh 2011) through pyro.infer.MCMC, constant step, cold posterior",
    reference="Welling & Teh, Bayesian Learning via Stochastic Gradient Langevin Dynamics (ICML 2011)",
    options=("lr", "temperature", "burn_in"),
    check=_check,
)
def fit_sgld(problem: Problem) -> Posterior:
    return _constant_sgld(problem, "sgld", None)


@register_method(
    "f_sgld",
    description="F-SGLD: SGLD on sharpness_aware(model, rho) (rho 0.05), same schedule as sgld",
    baseline="sgld",
    reference="Nguyen et al., Flat Seeking Bayesian Neural Networks (NeurIPS 2023), arXiv:2302.02713",
    options=("rho", "lr", "temperature", "burn_in", "looksam_k", "looksam_alpha", "rst_p"),
    check=_check,
)
def fit_f_sgld(problem: Problem) -> Posterior:
    return _constant_sgld(problem, "f_sgld", float(problem.option("f_sgld", "rho", 0.05)))


@register_method(
    "csgld",
    description="cyclical SGLD (cSGLD): cosine step-size cycles, draws at the end of each cycle",
    baseline="sgld",
    reference="Zhang et al., Cyclical Stochastic Gradient MCMC for Bayesian Deep Learning (ICLR 2020), "
    "arXiv:1902.03932",
    options=("lr", "cycles", "exploration", "temperature"),
    check=_check,
)
def fit_csgld(problem: Problem) -> Posterior:
    model = problem.build_model()
    cycles = int(problem.option("csgld", "cycles", 4))
    draws = problem.config.num_bma_samples
    per_cycle = math.ceil(draws / cycles)
    schedule = _csgld_schedule(problem)
    kernel = SGLD(model, step_size=schedule, temperature=float(problem.option("csgld", "temperature", 0.1)),
                  init_strategy=init_to_network(model), jit_compile=problem.compiled)
    samples = run_sgmcmc(problem, kernel, cycles * per_cycle, 0, model=model)
    return Posterior.from_samples(model, samples, draws, info={"cycle_length": schedule.cycle_length,
                                                               "cycles": cycles})


@register_method(
    "emcmc",
    description="Entropy-MCMC: SGLD on local_entropy(model, eta), theta and theta_a drawn (same schedule as sgld)",
    baseline="sgld",
    reference=REFERENCE_EMCMC,
    options=("lr", "eta", "temperature", "collect", "anchor_prior_scale", "cycles", "exploration", "burn_in"),
    check=_check,
)
def fit_emcmc(problem: Problem) -> Posterior:
    model = problem.build_model()
    lr = float(problem.option("emcmc", "lr", 0.3))
    collect = problem.option("emcmc", "collect", "both")
    draws = problem.config.num_bma_samples
    kept = _emcmc_kept(problem)
    schedule = _emcmc_schedule(problem)
    if schedule is None:  # constant step size, sgld's plan
        warmup, thinning = _constant_plan(problem, "emcmc", kept)
        step_size, info = problem.full_data_lr(lr), {"warmup_steps": warmup, "thinning": thinning}
    else:  # the authors' CIFAR schedule: cyclical cosine, draws at the end of every cycle
        cycles = int(problem.option("emcmc", "cycles", None))
        step_size, warmup, thinning, kept = schedule, 0, 1, schedule.samples_per_cycle * cycles
        info = {"cycle_length": schedule.cycle_length, "cycles": cycles}
    kernel = EntropyMCMC(
        model,
        eta=float(problem.option("emcmc", "eta", 0.01)),
        step_size=step_size,
        temperature=float(problem.option("emcmc", "temperature", 0.1)),
        collect=collect,
        anchor_prior_scale=problem.option("emcmc", "anchor_prior_scale", None),
        init_strategy=init_to_network(model),
        thinning=thinning,
        jit_compile=problem.compiled,
    )
    samples = local_entropy_draws(run_sgmcmc(problem, kernel, kept, warmup, model=model), collect)
    return Posterior.from_samples(model, samples, draws, info=info)

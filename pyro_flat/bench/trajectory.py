r"""Harness methods built on optimisation trajectories: SWA/SWAG, F-SWAG (SAM iterates), SAM, bSAM and HWA.

Every method starts at the network's own initialisation (:func:`~pyro_flat.nn.init_to_network`) and draws a fresh
random minibatch of ``batch_size`` points per step (``problem.num_steps`` steps), like the ``map`` baseline.

* ``sam_torch`` — MAP by :class:`~pyro_flat.optim.SAM` around ``torch.optim.Adam`` (lr = ``config.lr``,
  :math:`\rho` = 0.05) on the parameters of an ``AutoDelta`` guide; the closure is ``TensorTrace_ELBO`` / N on one
  minibatch (the prior acts as weight decay). Baseline ``map``.
* ``swa``, ``swag``, ``swag_diag`` — SWAG collected once per epoch after ``swa_start`` (default half the epochs) from
  the Adam MAP iterates; :math:`K=\min(20, \text{collected})`; SWA is the mean (one point), SWAG samples at scale 0.5,
  SWAG-Diagonal at scale 1.0. Baseline ``map``.
* ``f_swa``, ``f_swag``, ``f_swag_diag`` — the same collected from the SAM iterates (F-SWAG [1]); baselines ``swa``,
  ``swag``, ``swag_diag``. The F-BNN code evaluates F-SWAG at scale 0.1 and F-SWAG-Diagonal at 0.2: set
  ``--set f_swag.scale=0.1``.
* ``bsam`` — :class:`~pyro_flat.optim.BayesianSAM` on the ``AutoDelta`` parameters, closure = mean NLL of the
  minibatch, prior precision :math:`1/s_0^2` of the model's :math:`\mathcal N(0,s_0^2)` prior, cosine learning-rate
  decay over the run (as the authors' two-moons demo); the BMA averages draws from :math:`\mathcal N(m, 1/(Ns))`.
  Defaults: lr 0.5, :math:`\rho` 0.05, damping 0.1 (the authors'), and :math:`\beta_2` = 0.99 instead of their 0.999:
  with the 10^3-10^4 steps of a harness run :math:`s` would otherwise stay near its initial value (time constant
  :math:`1/(1-\beta_2)` steps; the authors' CIFAR runs take ~45 000 steps); chosen on a 1000/257 split of the digits
  training set. Baseline ``map`` (compare with ``sam_torch`` too).
* ``hwa``, ``hwa_total``, ``hwa_scales`` — ``AutoNormal`` SVI with Adam at ``config.lr`` for ``swa_start`` epochs,
  then SWA's cyclical rate (``config.lr`` down to ``config.lr * lr_low_ratio`` (0.01) in each one-epoch cycle) for the
  rest, averaging the guide at the end of every cycle; variance rule ``"means"`` (the draft's Algorithm 1),
  ``"total"`` or ``"scales"`` (:class:`~pyro_flat.infer.averaging.HWA`). Baseline ``vi``.
* ``vi_cyclical`` — the *last* iterate of the same cyclical SVI trajectory (what HWA averages over). Baseline ``vi``.

Options (``--set method.key=value``): ``swa_start`` (epochs; all trajectory methods), ``max_rank`` (20), ``scale``
(SWAG methods), ``rho`` (``sam_torch``/``f_*``: 0.05; ``bsam``: 0.05), ``m_sharpness`` (``sam_torch``, ``f_*``,
``bsam``: 1; the bSAM authors use 8), ``lr`` (``bsam``: 0.5; the others use ``config.lr``), ``beta2`` (``bsam``:
0.99), ``damping`` (0.1), ``init_scale`` (1.0), ``prior_precision`` (bsam: :math:`1/s_0^2`), ``dafactor`` (bsam: 1;
the authors' :math:`N_{\mathrm{eff}} = 4N` under data augmentation is 4), ``lr_low_ratio`` (HWA: 0.01),
``save_swag`` (SWAG methods: a file to save the collected moments to, e.g. a source posterior for
``sa_bma.backbone_swag``); the cheaper steps of :mod:`pyro_flat.ops.efficient_sam` (``sam_torch``, ``f_*``, ``bsam``):
``looksam_k``, ``looksam_alpha`` (LookSAM), ``rst_p`` (RST) and ``esam_gamma`` (ESAM's data selection: the closure
then returns the per-example losses :math:`-\log p(y_i\mid x_i,\theta)` (``sam_torch``, ``f_*``: plus
:math:`-\log p(\theta)/N`), one process only); the defaults take the ascent at every step on the whole minibatch.

References:
    * [1] `Flat Seeking Bayesian Neural Networks`, Van-Anh Nguyen, Tung-Long Vuong, Hoang Phan, Thanh-Toan Do,
      Dinh Phung, Trung Le (NeurIPS 2023), arXiv:2302.02713
    * [2] `SAM as an Optimal Relaxation of Bayes`, Thomas Möllenhoff, Mohammad Emtiyaz Khan (ICLR 2023),
      arXiv:2210.01620
    * [3] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Wesley Maddox, Timur Garipov, Pavel Izmailov,
      Dmitry Vetrov, Andrew Gordon Wilson (NeurIPS 2019), arXiv:1902.02476
    * [4] `Hyperparameters Weight Averaging in Bayesian Neural Networks`, Belhal Karimi, Ping Li (AABI 2020),
      OpenReview QkMt2L5Uon6
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch import Tensor

from ..infer.autoguide import SWAGCollector
from ..infer.averaging import HWA
from ..metrics import model_loss_fn
from ..nn import BayesianClassifier, init_to_network, unpacked_sites
from ..optim import SAM, BayesianSAM
from .files import atomic_save
from .problem import LossModule, OptimSpec, Posterior, Problem, run_svi
from .registry import register_method
from .schedules import CosineDecay, CyclicalLR

CHEAPER_STEPS = ("looksam_k", "looksam_alpha", "rst_p", "esam_gamma")
"""The options of the cheaper sharpness-aware steps (:mod:`pyro_flat.ops.efficient_sam`)."""
_FBNN = "Nguyen et al., Flat Seeking Bayesian Neural Networks (NeurIPS 2023), arXiv:2302.02713"
_SWAG = "Maddox et al., A Simple Baseline for Bayesian Uncertainty in Deep Learning (NeurIPS 2019), arXiv:1902.02476"
_BSAM = "Möllenhoff & Khan, SAM as an Optimal Relaxation of Bayes (ICLR 2023), arXiv:2210.01620"
_HWA = "Karimi & Li, Hyperparameters Weight Averaging in Bayesian Neural Networks (AABI 2020)"


# ---------------------------------------------------------------------------------------------------------------------
# the shared trajectory loop
# ---------------------------------------------------------------------------------------------------------------------


def _swa_start(problem: Problem, method: str) -> int:
    start = problem.option(method, "swa_start", problem.config.num_epochs // 2)
    if not (isinstance(start, int) and 0 <= start < problem.config.num_epochs):
        raise ValueError(f"{method}.swa_start must be an int in [0, {problem.config.num_epochs}), got {start!r}")
    return start


def _check_snapshots(problem: Problem, method: str) -> None:
    """Refuse, before training, a SWAG schedule that collects fewer than the 2 snapshots (deviation columns) its
    low-rank term needs: one per epoch from ``swa_start``, at most ``max_rank`` kept."""
    epochs = problem.config.num_epochs
    given = problem.option(method, "swa_start", None)
    start = _swa_start(problem, method)
    max_rank = problem.option(method, "max_rank", 20)
    diagonal = f"{method}_diag (the diagonal alone)"
    if max_rank < 2:
        raise ValueError(f"{method}: --set {method}.max_rank={max_rank} keeps fewer than the 2 deviation columns its "
                         f"low-rank term needs; use max_rank >= 2, or {diagonal}")
    collected = epochs - start
    if collected < 2:
        fixes = [f"--epochs {start + 2 if given is not None else 3} or more"]
        if epochs >= 2:
            fixes.append(f"--set {method}.swa_start={epochs - 2}")
        raise ValueError(f"{method}: its low-rank term needs 2 snapshots, and this run collects {collected} (one per "
                         f"epoch from swa_start={start} to --epochs {epochs}); use {' or '.join(fixes)}, or "
                         f"{diagonal}")


def _delta_guide(problem: Problem, model: BayesianClassifier) -> AutoDelta:
    guide = AutoDelta(model, init_loc_fn=init_to_network(model))
    guide(problem.data.x_train[:2], problem.data.y_train[:2])  # create the parameters
    return guide


def _run_closure_optimizer(
    problem: Problem,
    optimizer: torch.optim.Optimizer,
    make_loss: Callable[[Tensor, Tensor, int], Callable[..., Tensor]],
    num_splits: int,
    *,
    state: dict[str, object],
    callback: Callable[[int], None] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    log_every: int = 50,
) -> list[float]:
    """Run a closure-based optimizer over ``problem.num_steps`` minibatches (one checkpointed phase; ``state`` names
    what else it changes), each split into ``num_splits`` sub-batches (m-sharpness), ``make_loss(x, y, N)`` giving
    the loss of a sub-batch (ESAM's per-example closure when the optimizer's ``esam_gamma`` is below 1); returns every
    ``log_every``-th loss."""
    b = problem.shard_size
    if not (isinstance(num_splits, int) and 1 <= num_splits <= b):
        raise ValueError(f"m_sharpness must be an int in [1, batch size {b}], got {num_splits!r}")

    def closure_for(x: Tensor, y: Tensor, num_data: int) -> Callable[..., Tensor]:
        loss_fn = make_loss(x, y, num_data)
        if getattr(optimizer, "esam_gamma", 1) < 1:  # ESAM's per-example closure: the optimizer differentiates
            return loss_fn

        def closure() -> Tensor:
            loss = loss_fn()
            loss.backward()
            return loss

        return closure

    objects = {**state, "optim": optimizer} | ({} if scheduler is None else {"schedule": scheduler})
    loop = problem.loop(problem.num_steps, objects, explicit=True, log_every=log_every, name=type(optimizer).__name__)
    for step, ((x, y), kwargs) in loop:
        parts = zip(x.tensor_split(num_splits), y.tensor_split(num_splits), strict=True)
        loop.record(optimizer.step([closure_for(xs, ys, kwargs["num_data"]) for xs, ys in parts]))
        if scheduler is not None:
            scheduler.step()
        if callback is not None:
            callback(step)
    return loop.history


def _map_loss(
    problem: Problem, model: BayesianClassifier, guide: AutoDelta
) -> Callable[[Tensor, Tensor, int], Callable[[], Tensor]]:
    """(x, y, N) -> a function computing the negative log joint per datum, -log p(y_B, theta) / N, on the minibatch
    (through DistributedDataParallel when data-parallel)."""
    module = problem.data_parallel(problem.base_loss()(model, guide))
    return lambda x, y, n: lambda: module(x, y, num_data=n) / n


def _per_example_loss(
    problem: Problem, model: BayesianClassifier, guide: AutoDelta, *, prior: bool
) -> Callable[[Tensor, Tensor, int], Callable[[Tensor | None], Tensor]]:
    r"""(x, y, N) -> ESAM's per-example closure ``closure(subset)``: :math:`-\log p(y_i\mid x_i,\theta)` of each
    example of the minibatch (or of those at ``subset``), minus :math:`\log p(\theta)/N` with ``prior`` (their mean
    is then :func:`_map_loss`'s)."""
    if problem.distributed:
        raise ValueError("esam_gamma (ESAM's data selection) runs in one process: its per-example closure is not "
                         "data-parallel")

    def make(x: Tensor, y: Tensor, num_data: int) -> Callable[[Tensor | None], Tensor]:
        def closure(subset: Tensor | None) -> Tensor:
            xs, ys = (x, y) if subset is None else (x[subset], y[subset])
            values = guide()
            trace = poutine.trace(poutine.condition(model, data=values)).get_trace(xs, ys, num_data=num_data)
            obs = trace.nodes["obs"]
            losses = -obs["fn"].log_prob(obs["value"])
            if prior:
                log_prior = sum(trace.nodes[name]["fn"].log_prob(value).sum() for name, value in values.items())
                losses = losses - log_prior / num_data
            return losses

        return closure

    return make


def _cheaper_steps(problem: Problem, method: str) -> dict[str, object]:
    """The method's LookSAM, RST and ESAM options (those it was given)."""
    keys = ("looksam_k", "looksam_alpha", "rst_p", "esam_gamma")
    return {key: problem.option(method, key, None) for key in keys if problem.option(method, key, None) is not None}


def _trained_parameters(model: BayesianClassifier, guide: AutoDelta) -> list[Tensor]:
    """The guide's parameters and the network's learned (non-latent) ones."""
    return list(guide.parameters()) + list(model.parameters())


def _collector_callback(problem: Problem, method: str, guide: AutoDelta) -> tuple[SWAGCollector, Callable]:
    collector = SWAGCollector(problem.option(method, "max_rank", 20))
    start = _swa_start(problem, method) * problem.steps_per_epoch
    return collector, collector.callback(guide.median, every=problem.steps_per_epoch, start=start)


def _adam_trajectory(problem: Problem, method: str) -> tuple[BayesianClassifier, SWAGCollector, list[float]]:
    """MAP by Adam through Pyro's SVI (as ``map``), collecting SWAG iterates once per epoch after swa_start."""
    model = problem.build_model()
    guide = AutoDelta(model, init_loc_fn=init_to_network(model))
    guide(problem.data.x_train[:2], problem.data.y_train[:2])
    collector, callback = _collector_callback(problem, method, guide)
    history = run_svi(problem, model, guide, callback=callback, state={"collector": collector})
    return model, collector, history


def _sam_trajectory(problem: Problem, method: str) -> tuple[BayesianClassifier, AutoDelta, SWAGCollector, list]:
    """MAP by SAM(Adam), collecting SWAG iterates once per epoch after swa_start (F-SWAG)."""
    model = problem.build_model()
    guide = _delta_guide(problem, model)
    collector, callback = _collector_callback(problem, method, guide)
    spec = problem.optim_spec(mean_loss=True)
    cheaper = _cheaper_steps(problem, method)
    optimizer = SAM(_trained_parameters(model, guide), spec.cls, rho=problem.option(method, "rho", 0.05), **cheaper,
                    **spec.args)
    scheduler = None if spec.lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(optimizer, spec.lr_lambda)
    loss = (_per_example_loss(problem, model, guide, prior=True) if "esam_gamma" in cheaper
            else _map_loss(problem, model, guide))
    history = _run_closure_optimizer(problem, optimizer, loss, problem.option(method, "m_sharpness", 1),
                                     callback=callback, scheduler=scheduler,
                                     state={"model": model, "guide": guide, "collector": collector})
    return model, guide, collector, history


def _swag_posterior(problem: Problem, method: str, model: BayesianClassifier, collector: SWAGCollector,
                    kind: str, history: list[float]) -> Posterior:
    info = {"losses": history, "num_collected": collector.num_collected, "rank": collector.rank}
    path = problem.option(method, "save_swag", None)
    if path is not None and problem.rank == 0:  # e.g. the source posterior of a transfer's frozen layers
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        state = collector.state_dict()
        for packed, tensors in unpacked_sites(model).items():  # saved per weight tensor, as a transfer reads it
            if list(state["sites"]) == [packed]:
                state["sites"] = {name: tuple(shape) for name, shape in tensors.items()}
                state["supports"] = {}
        atomic_save(state, Path(path))
    if kind == "swa":
        return Posterior.from_points(model, [collector.mean()], info=info)
    diagonal = kind == "swag_diag"
    scale = problem.option(method, "scale", 1.0 if diagonal else 0.5)
    guide = collector.guide(model, scale=scale, diagonal_only=diagonal)
    guide(problem.data.x_train[:2])  # set up the prototype (draws are then taken without model arguments)
    info["num_clamped"] = int(collector.num_clamped())
    return Posterior.from_guide(model, guide, problem.config.num_bma_samples, info=info)


# ---------------------------------------------------------------------------------------------------------------------
# SAM, SWA/SWAG and F-SWAG
# ---------------------------------------------------------------------------------------------------------------------


@register_method("sam_torch", description="SAM(Adam) MAP: pyro_flat.optim.SAM on AutoDelta, rho 0.05",
                 baseline="map", reference="Foret et al., SAM (ICLR 2021), arXiv:2010.01412",
                 options=("rho", "m_sharpness", "swa_start", "max_rank", *CHEAPER_STEPS))
def fit_sam_torch(problem: Problem) -> Posterior:
    model, guide, _, history = _sam_trajectory(problem, "sam_torch")
    return Posterior.from_points(model, [guide.median()], info={"losses": history})


def _register_swag(name: str, kind: str, source: str, baseline: str, description: str) -> None:
    options = ("swa_start", "max_rank", "save_swag") + (("scale",) if kind != "swa" else ()) + (
        ("rho", "m_sharpness", *CHEAPER_STEPS) if source == "sam" else ())

    @register_method(name, description=description, baseline=baseline, reference=_FBNN if source == "sam" else _SWAG,
                     options=options, check=_check_snapshots if kind == "swag" else None)
    def fit(problem: Problem) -> Posterior:
        if source == "sam":
            model, _, collector, history = _sam_trajectory(problem, name)
        else:
            model, collector, history = _adam_trajectory(problem, name)
        return _swag_posterior(problem, name, model, collector, kind, history)


_register_swag("swa", "swa", "adam", "map", "SWA: mean of the Adam MAP iterates (once per epoch after swa_start)")
_register_swag("swag", "swag", "adam", "map", "SWAG (diag + rank 20, scale 0.5) from the Adam MAP iterates")
_register_swag("swag_diag", "swag_diag", "adam", "map", "SWAG-Diagonal (scale 1) from the Adam MAP iterates")
_register_swag("f_swa", "swa", "sam", "swa", "F-SWA: mean of the SAM(Adam) iterates")
_register_swag("f_swag", "swag", "sam", "swag", "F-SWAG: SWAG (scale 0.5) from the SAM(Adam) iterates")
_register_swag("f_swag_diag", "swag_diag", "sam", "swag_diag", "F-SWAG-Diagonal (scale 1) from the SAM iterates")


# ---------------------------------------------------------------------------------------------------------------------
# Bayesian SAM
# ---------------------------------------------------------------------------------------------------------------------


@register_method("bsam", description="Bayesian SAM: pyro_flat.optim.BayesianSAM, BMA over N(m, 1/(N s))",
                 baseline="map", reference=_BSAM,
                 options=("lr", "rho", "prior_precision", "damping", "beta2", "init_scale", "dafactor", "m_sharpness",
                          *CHEAPER_STEPS))
def fit_bsam(problem: Problem) -> Posterior:
    model = problem.build_model()
    guide = _delta_guide(problem, model)
    dafactor = problem.option("bsam", "dafactor", 1)
    optimizer = BayesianSAM(
        _trained_parameters(model, guide),
        lr=problem.option("bsam", "lr", 0.5),
        num_data=problem.data.num_data * dafactor,
        rho=problem.option("bsam", "rho", 0.05),
        prior_precision=problem.option("bsam", "prior_precision", 1.0 / problem.config.prior_scale**2),
        damping=problem.option("bsam", "damping", 0.1),
        beta2=problem.option("bsam", "beta2", 0.99),
        init_scale=problem.option("bsam", "init_scale", 1.0),
        **_cheaper_steps(problem, "bsam"),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CosineDecay(problem.num_steps))
    if optimizer.esam_gamma < 1:
        make_loss = _per_example_loss(problem, model, guide, prior=False)
    else:
        nll = problem.data_parallel(LossModule(
            lambda x, y, n: model_loss_fn(model, x, y, num_data=n)(guide()), guide, model,
            compiled=problem.compiled and not problem.distributed,
        ))

        def make_loss(x: Tensor, y: Tensor, n: int) -> Callable[[], Tensor]:
            return lambda: nll(x, y, n)

    history = _run_closure_optimizer(problem, optimizer, make_loss,
                                     problem.option("bsam", "m_sharpness", 1), scheduler=scheduler,
                                     state={"model": model, "guide": guide})

    def draws(num: int) -> Iterator[dict[str, Tensor]]:
        for _ in range(num):
            yield optimizer.sampled_draw(guide.median)

    std = torch.cat([s.reshape(-1) for s in optimizer.posterior_std()])
    info = {"losses": history, "posterior_std_median": float(std.median()), "posterior_std_max": float(std.max())}
    return Posterior(model, draws, problem.config.num_bma_samples, info=info)


# ---------------------------------------------------------------------------------------------------------------------
# HWA
# ---------------------------------------------------------------------------------------------------------------------


def _hwa_trajectory(problem: Problem, method: str) -> tuple[BayesianClassifier, AutoNormal, HWA, list[float]]:
    """AutoNormal SVI: swa_start epochs at the constant Adam rate, then cyclical rates (one-epoch cycles), averaging
    the guide at the end of every cycle."""
    model = problem.build_model()
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=problem.config.vi_init_scale)
    spe = problem.steps_per_epoch
    pretrain = _swa_start(problem, method) * spe
    history = run_svi(problem, model, guide, num_steps=pretrain) if pretrain > 0 else []
    if pretrain == 0:
        guide(problem.data.x_train[:2], problem.data.y_train[:2])
    spec = problem.optim_spec()
    lr = spec.args["lr"]
    cyclical = OptimSpec(spec.cls, spec.args, CyclicalLR(spe, lr * problem.option(method, "lr_low_ratio", 0.01) / lr))
    hwa = HWA(guide, max_rank=problem.option(method, "max_rank", 20))
    history += run_svi(problem, model, guide, optim=cyclical, num_steps=problem.num_steps - pretrain,
                       callback=hwa.callback(spe), state={"hwa": hwa})
    return model, guide, hwa, history


def _register_hwa(name: str, rule: str, description: str) -> None:
    @register_method(name, description=description, baseline="vi", reference=_HWA,
                     options=("swa_start", "lr_low_ratio", "max_rank"))
    def fit(problem: Problem) -> Posterior:
        model, _, hwa, history = _hwa_trajectory(problem, name)
        guide = hwa.averaged_guide(model, variance=rule)
        guide(problem.data.x_train[:2])
        info = {"losses": history, "num_collected": hwa.num_collected, "num_clamped": int(hwa.num_clamped())}
        return Posterior.from_guide(model, guide, problem.config.num_bma_samples, info=info)


_register_hwa("hwa", "means", "HWA: average of the AutoNormal means per cycle, variance = spread of the means")
_register_hwa("hwa_total", "total", "HWA, law of total variance: mean SVI variance + spread of the means")
_register_hwa("hwa_scales", "scales", "HWA averaging both AutoNormal means and scales (SWA of the parameters)")


@register_method("vi_cyclical", description="last iterate of HWA's cyclical-rate SVI trajectory (no averaging)",
                 baseline="vi", reference=_HWA, options=("swa_start", "lr_low_ratio", "max_rank"))
def fit_vi_cyclical(problem: Problem) -> Posterior:
    model, guide, _, history = _hwa_trajectory(problem, "vi_cyclical")
    return Posterior.from_guide(model, guide, problem.config.num_bma_samples, info={"losses": history})


__all__ = ["fit_bsam", "fit_sam_torch", "fit_vi_cyclical"]

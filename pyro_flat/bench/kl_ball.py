r"""SA-BMA's KL-ball adversarial ELBO in the comparison harness (whole-network inference, from the network's init).

* ``vi_low_rank``: VI with the low-rank-plus-diagonal guide
  (:class:`~pyro_flat.infer.autoguide.AutoLowRankPlusDiagonalNormal`) and ``Trace_ELBO`` — the non-flat baseline with
  the same family;
* ``sa_bma``: the same guide trained by :class:`~pyro_flat.infer.elbo.KLBallELBO` with the Fisher direction (the
  paper's update);
* ``sa_bma_score``: the same with the normalised-score direction of the authors' code;
* ``sa_bma_diag``: ``KLBallELBO`` with the mean-field ``AutoNormal`` guide, the flat counterpart of ``vi``.

Options (``--set METHOD.KEY=VALUE``): ``radius`` (the KL radius in nats; default 1.0 for the Fisher direction and
0.01 for the normalised score, i.e. a Euclidean step of 0.14 per block; chosen before any run, the README shows a
sweep), ``rank`` (default 5), ``kl_weight`` (default 1). For transfer (``resnet18_imagenet`` with ``pretrained`` and
``latent="norm_and_head"``), ``backbone_swag=FILE`` re-samples the frozen weights from a source SWAG posterior at
every step and for every BMA draw, as SA-BMA does (``vi_low_rank``, ``sa_bma``, ``sa_bma_score``; ``backbone_scale``
default 0.5); make the file with ``swag`` and ``save_swag=FILE`` on the network with every weight latent.

Reference: `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
"""

from __future__ import annotations

from collections.abc import Iterator

from pyro.infer.autoguide import AutoNormal
from torch import Tensor, nn

from ..infer import AutoLowRankPlusDiagonalNormal, JitKLBallELBO, KLBallELBO
from ..infer.autoguide import SWAGCollector
from ..infer.predict import guide_draws
from ..nn import init_to_network
from ..nn.transfer import SWAGFrozenSampler
from .files import load_checkpoint
from .problem import Posterior, Problem, run_svi
from .registry import register_method

REFERENCE = "Lim et al. 2024, Flat Posterior Does Matter For Bayesian Model Averaging, arXiv:2406.15664"
DEFAULT_RADIUS = {"fisher": 1.0, "normalized_score": 0.01}


def _kl_ball(problem: Problem) -> type[KLBallELBO]:
    """``KLBallELBO``, compiled when ``problem.compiled``."""
    return JitKLBallELBO if problem.compiled else KLBallELBO


def _low_rank_fit(problem: Problem, method: str, loss_factory: type | None, direction: str = "fisher") -> Posterior:
    model = problem.build_model()
    rank = problem.option(method, "rank", 5)
    guide = AutoLowRankPlusDiagonalNormal(
        model, init_loc_fn=init_to_network(model), init_scale=problem.config.vi_init_scale, rank=rank
    )
    info = {"rank": rank}
    if loss_factory is None:
        loss = problem.base_loss()
    else:
        info["radius"] = problem.option(method, "radius", DEFAULT_RADIUS[direction])
        info["kl_weight"] = problem.option(method, "kl_weight", 1.0)
        loss = loss_factory(info["radius"], direction=direction, kl_weight=info["kl_weight"],
                            distributed=problem.distributed)
    sampler = _frozen_sampler(problem, method, model)
    info["losses"] = run_svi(problem, model, guide, loss)
    if sampler is None:
        return Posterior.from_guide(model, guide, problem.config.num_bma_samples, info=info)

    def draws(num: int) -> Iterator[dict[str, Tensor]]:  # a new frozen block with every posterior draw
        for draw in guide_draws(guide, num):
            sampler.resample()
            yield draw

    info["backbone_swag"] = str(problem.option(method, "backbone_swag", None))
    return Posterior(model, draws, problem.config.num_bma_samples, info=info)


def _frozen_sampler(problem: Problem, method: str, model: nn.Module) -> SWAGFrozenSampler | None:
    """With ``backbone_swag=FILE`` (a saved :class:`~pyro_flat.infer.autoguide.SWAGCollector` state of the source
    network, e.g. ``swag`` with ``save_swag``): re-sample the frozen weights from it at every step (SA-BMA's scheme)."""
    path = problem.option(method, "backbone_swag", None)
    if path is None:
        return None
    state = load_checkpoint(path)
    collector = SWAGCollector(state["max_rank"])
    collector.load_state_dict(state)
    return SWAGFrozenSampler.from_swag(model, collector, scale=problem.option(method, "backbone_scale", 0.5),
                                       diagonal_only=collector.rank < 2)


@register_method(
    "vi_low_rank",
    description="VI with the low-rank-plus-diagonal guide (AutoLowRankPlusDiagonalNormal + TensorTrace_ELBO)",
    options=("rank", "backbone_swag", "backbone_scale"),
)
def fit_vi_low_rank(problem: Problem) -> Posterior:
    return _low_rank_fit(problem, "vi_low_rank", None)


SA_BMA = {"baseline": "vi_low_rank", "reference": REFERENCE,
          "options": ("rank", "radius", "kl_weight", "backbone_swag", "backbone_scale")}
"""What the two SA-BMA variants share in the registry."""


@register_method("sa_bma", description="SA-BMA: KLBallELBO (Fisher direction) + low-rank-plus-diagonal guide", **SA_BMA)
def fit_sa_bma(problem: Problem) -> Posterior:
    return _low_rank_fit(problem, "sa_bma", _kl_ball(problem))


@register_method("sa_bma_score", description="SA-BMA, authors' code variant: KLBallELBO (normalised score) + "
                 "low-rank-plus-diagonal guide", **SA_BMA)
def fit_sa_bma_score(problem: Problem) -> Posterior:
    return _low_rank_fit(problem, "sa_bma_score", _kl_ball(problem), direction="normalized_score")


@register_method(
    "sa_bma_diag",
    description="KLBallELBO (Fisher direction) + mean-field AutoNormal guide",
    baseline="vi",
    reference=REFERENCE,
    options=("radius", "kl_weight"),
)
def fit_sa_bma_diag(problem: Problem) -> Posterior:
    model = problem.build_model()
    guide = AutoNormal(model, init_loc_fn=init_to_network(model), init_scale=problem.config.vi_init_scale)
    radius = problem.option("sa_bma_diag", "radius", DEFAULT_RADIUS["fisher"])
    kl_weight = problem.option("sa_bma_diag", "kl_weight", 1.0)
    history = run_svi(problem, model, guide, _kl_ball(problem)(radius, kl_weight=kl_weight,
                                                                distributed=problem.distributed))
    info = {"losses": history, "radius": radius, "kl_weight": kl_weight}
    return Posterior.from_guide(model, guide, problem.config.num_bma_samples, info=info)

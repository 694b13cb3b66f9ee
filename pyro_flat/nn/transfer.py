r"""Bayesian transfer learning: a pretrained torch network whose normalisation layers and (new) head are latent.

:func:`bayesian_transfer` turns a network trained on a *source* task into a Pyro classifier for a *target* task, in
the scheme of SA-BMA [1] (and of Bayesian parameter-efficient fine-tuning in general): the head is replaced by a
fresh ``nn.Linear`` for the target classes, and only the affine parameters of the normalisation layers
and the head become random,

.. math:: \theta_{\rm norm} \sim \mathcal N(\theta_{\rm norm}^{\rm pre},\ s^2 I), \qquad
    \theta_{\rm head} \sim \mathcal N(0,\ s_{\rm head}^2 I)
    \quad(\text{or } \mathcal N(\theta_{\rm head}^{\rm pre}, s^2 I) \text{ if the pretrained head is kept}),

where :math:`\theta^{\rm pre}` are the pretrained values. The other parameters are frozen at their pretrained values
(buffers, so no optimiser touches them) or stay learnable point estimates (``rest="learned"``). The result is an
ordinary :class:`~pyro_flat.nn.BayesianClassifier`, so any Pyro inference applies: ``SVI`` with
:class:`~pyro_flat.infer.elbo.KLBallELBO` and :class:`~pyro_flat.infer.autoguide.AutoLowRankPlusDiagonalNormal`
(SA-BMA), mean-field VI, SWAG, MCMC.

In SA-BMA the frozen block is not a point but is re-sampled from a SWAG posterior of the source network at every
step; :class:`SWAGFrozenSampler` does that for any transferred network (the default frozen block is a point, the
pretrained weights).

References:
    * [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
      Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
"""

from __future__ import annotations

import copy as copy_module
import math

import torch
from torch import nn

from .._validation import check_int, check_real
from .bayesian import (
    _PRIOR_LOC,
    _PRIOR_SCALE,
    NORM_LAYERS,
    RandomSpec,
    head_module_name,
    make_bayesian,
    pack_latents,
)
from .models import BayesianClassifier

__all__ = ["SWAGFrozenSampler", "bayesian_transfer", "replace_head"]


def replace_head(net: nn.Module, num_classes: int, *, head: str | None = None) -> nn.Linear:
    """Replace the ``nn.Linear`` head of ``net`` **in place** by a freshly initialised one with ``num_classes``
    outputs (same input width, bias, device and dtype; torch's default initialisation).

    :param net: a torch network.
    :param num_classes: the number of classes of the target task, ``>= 2``.
    :param head: the qualified module name of the head (default: the last ``nn.Linear``/conv layer in module order,
        :func:`~pyro_flat.nn.head_module_name`).
    :returns: the new head.
    """
    check_int(num_classes, "num_classes", minimum=2)
    head = head_module_name(net) if head is None else head
    modules = dict(net.named_modules())
    if head not in modules:
        raise ValueError(f"`head` {head!r} is not a module of the network; known linear layers: "
                         f"{[n for n, m in modules.items() if isinstance(m, nn.Linear)]}")
    old = modules[head]
    if not isinstance(old, nn.Linear):
        raise ValueError(f"the head {head!r} must be an nn.Linear to be replaced, got {type(old).__name__}")
    new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None, device=old.weight.device,
                    dtype=old.weight.dtype)
    parent_name, _, child = head.rpartition(".")
    setattr(net.get_submodule(parent_name) if parent_name else net, child, new)
    return new


def bayesian_transfer(
    net: nn.Module,
    num_classes: int,
    *,
    head: str | None = None,
    random: RandomSpec = "norm_and_head",
    prior_scale: float = 1.0,
    head_prior_scale: float = 1.0,
    new_head: bool = True,
    rest: str = "frozen",
    copy: bool = True,
    packed: bool = True,
) -> BayesianClassifier:
    r"""A Bayesian classifier for a target task from a network pretrained on a source task.

    :param net: the pretrained torch network (e.g. a torchvision ResNet: its head is ``"fc"``, its normalisation
        layers are the ``BatchNorm2d`` s), mapping ``[B, ...]`` inputs to logits.
    :param num_classes: the number of target classes.
    :param head: the qualified name of the head module (default: the last linear/conv layer).
    :param random: which parameters are latent: ``"norm_and_head"`` (default; normalisation affine parameters and
        the head, as in SA-BMA), or anything :func:`~pyro_flat.nn.make_bayesian` accepts.
    :param prior_scale: :math:`s > 0`, the prior standard deviation around the pretrained values (default 1).
    :param head_prior_scale: :math:`s_{\rm head} > 0`, the prior standard deviation of a *new* head, centred at zero
        (default 1).
    :param new_head: replace the head by a freshly initialised ``nn.Linear`` with ``num_classes`` outputs (default,
        the target task's classes are new, as in SA-BMA, whose classifier starts at zero); ``False`` keeps the
        pretrained head (then it must already have ``num_classes`` outputs) with the prior around its values.
    :param rest: ``"frozen"`` (default; the other parameters become buffers at their pretrained values) or
        ``"learned"`` (they stay ``pyro.param`` point estimates).
    :param copy: work on a deep copy of ``net`` (default) rather than converting it in place.
    :param packed: the latent parameters as one sample site ``"net.weights"`` (:func:`~pyro_flat.nn.pack_latents`,
        default ``True``) or one per tensor (``False``).
    :returns: a :class:`~pyro_flat.nn.BayesianClassifier` called as ``model(x, y=None, *, subsample_size=None,
        num_data=None)``.

    Example (a torchvision network; nothing is downloaded if its weights are already on disk)::

        net = torchvision.models.resnet18(weights="IMAGENET1K_V1")  # doctest: +SKIP
        model = bayesian_transfer(net, num_classes=10, prior_scale=0.1)
        guide = AutoLowRankPlusDiagonalNormal(model, init_loc_fn=init_to_network(model), init_scale=1e-3)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), KLBallELBO(radius=0.01))
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"`net` must be a torch.nn.Module, got {type(net).__name__}")
    check_real(head_prior_scale, "head_prior_scale", low=0, low_open=True)
    net = copy_module.deepcopy(net) if copy else net
    head = head_module_name(net) if head is None else head
    if new_head:
        replace_head(net, num_classes, head=head)
    elif getattr(dict(net.named_modules()).get(head), "out_features", None) != num_classes:
        raise ValueError(
            f"new_head=False keeps the pretrained head {head!r}, which must have num_classes={num_classes} outputs"
        )
    selection = random
    if isinstance(random, str) and random == "norm_and_head":  # with the head named here, not guessed again

        def selection(module_name: str, module: nn.Module, _param: str) -> bool:
            return isinstance(module, NORM_LAYERS) or module_name == head

    make_bayesian(net, random=selection, prior_scale=prior_scale, prior_loc="current", rest=rest, packed=False)
    if new_head:
        head_module = net.get_submodule(head)
        for name, buffer in list(head_module.named_buffers(recurse=False)):
            if name.startswith(_PRIOR_LOC):
                setattr(head_module, name, torch.zeros_like(buffer))
            elif name.startswith(_PRIOR_SCALE):
                setattr(head_module, name, torch.full_like(buffer, float(head_prior_scale)))
    if packed:
        pack_latents(net)
    return BayesianClassifier(net, num_classes)


class SWAGFrozenSampler:
    r"""Re-samples the frozen weights of a transferred network from a SWAG posterior of the source network (SA-BMA's
    scheme, [1] in the module docstring).

    For the frozen weights :math:`\theta_f` (the buffers :func:`bayesian_transfer` left at their pretrained values) it
    draws, from the SWAG Gaussian's marginal on them (the rows of its moments),

    .. math:: \theta_f = \bar\theta_f + \sqrt{s}\,\Big(\sigma_f \odot z_1 + \frac{D_f z_2}{\sqrt{K-1}}\Big),
        \qquad z_1 \sim \mathcal N(0, I),\ z_2 \sim \mathcal N(0, I_K),

    with :math:`s` the ``scale`` (0.5 is SWAG's :math:`\tfrac12(\Sigma_{\rm diag}+DD^\top/(K-1))`) and writes it into
    the network, in place and without gradient. A new draw is made before every forward pass in training mode with
    gradients enabled — every training step, and the perturbed pass of a flat objective replays the same draw (it
    replays the random state) — and by :meth:`resample`, which a Bayesian model average calls once per posterior
    draw so that the BatchNorm refresh and the prediction of a draw share one frozen block.

    :param model: the Bayesian network (e.g. from :func:`bayesian_transfer`); its ``net`` holds the frozen buffers.
    :param mean: ``{name: tensor}`` of the source SWAG mean, names relative to ``model.net`` (``"layer1.0.conv1
        .weight"``); every name must be a buffer of ``model.net``.
    :param variance: ``{name: tensor}``, the diagonal variance :math:`\sigma^2`.
    :param deviations: ``{name: tensor [*shape, K]}``, the deviation columns :math:`D` (``K >= 2``), or ``None`` for
        the diagonal part alone.
    :param float scale: :math:`s > 0` (default 0.5).
    """

    def __init__(
        self,
        model: nn.Module,
        mean: dict[str, torch.Tensor],
        variance: dict[str, torch.Tensor],
        deviations: dict[str, torch.Tensor] | None = None,
        *,
        scale: float = 0.5,
    ) -> None:
        check_real(scale, "scale", low=0, low_open=True, owner="SWAGFrozenSampler")
        net = model.net
        buffers = dict(net.named_buffers())
        unknown = [name for name in mean if name not in buffers]
        if unknown or not mean:
            raise ValueError(f"SWAGFrozenSampler: {unknown or 'no names'} are not frozen weights (buffers) of the "
                             f"network; expected names among {sorted(buffers)[:5]}...")
        self.targets = {name: buffers[name] for name in mean}
        for name, target in self.targets.items():
            if mean[name].shape != target.shape:
                raise ValueError(f"SWAGFrozenSampler: {name} has shape {tuple(target.shape)}, the SWAG mean "
                                 f"{tuple(mean[name].shape)}")
        like = next(iter(self.targets.values()))
        self.mean = {k: v.to(like) for k, v in mean.items()}
        self.std = {k: variance[k].to(like).sqrt() for k in mean}
        self.deviations = None if deviations is None else {k: deviations[k].to(like) for k in mean}
        self.rank = 0 if deviations is None else next(iter(self.deviations.values())).shape[-1]
        if self.deviations is not None and self.rank < 2:
            raise ValueError("SWAGFrozenSampler: the low-rank term needs K >= 2 deviation columns; pass "
                             "deviations=None for the diagonal part alone")
        self.scale = float(scale)
        self.handle = net.register_forward_pre_hook(self._before_forward)

    @classmethod
    def from_swag(
        cls,
        model: nn.Module,
        collector: object,
        *,
        prefix: str = "net.",
        scale: float = 0.5,
        diagonal_only: bool = False,
    ) -> SWAGFrozenSampler:
        """From a :class:`~pyro_flat.infer.autoguide.SWAGCollector` of the source network (e.g. SWAG of all its
        weights, site names ``prefix + name``): its moments restricted to the frozen buffers of ``model.net``."""
        frozen = {name for name, _ in model.net.named_buffers()}
        keep = [site for site in collector.sites if site.startswith(prefix) and site[len(prefix) :] in frozen]
        if not keep:
            raise ValueError(f"SWAGFrozenSampler.from_swag: no site of the collector ({list(collector.sites)[:3]}...) "
                             f"names a frozen weight of the network")
        mean, variance = collector.mean(), collector.variance()
        deviations = None
        if not diagonal_only:
            columns, deviations, start = collector.deviation_matrix(), {}, 0
            for site, shape in collector.sites.items():
                size = math.prod(shape)
                deviations[site] = columns[start : start + size].reshape(*shape, columns.shape[-1])
                start += size
        strip = {site: site[len(prefix) :] for site in keep}
        return cls(model, {strip[k]: mean[k] for k in keep}, {strip[k]: variance[k] for k in keep},
                   None if deviations is None else {strip[k]: deviations[k] for k in keep}, scale=scale)

    @torch.no_grad()
    def resample(self) -> None:
        """Draw the frozen weights anew (one draw of the SWAG marginal) and write them into the network."""
        first = next(iter(self.mean.values()))
        z2 = None if self.deviations is None else torch.randn(self.rank, dtype=first.dtype, device=first.device)
        root = math.sqrt(self.scale)
        for name, target in self.targets.items():
            value = self.std[name] * torch.randn_like(target)
            if z2 is not None:
                value = value + self.deviations[name] @ z2 / math.sqrt(self.rank - 1)
            target.copy_(self.mean[name] + root * value)

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            self.resample()

    def remove(self) -> None:
        """Stop re-sampling before forward passes (the last draw stays in the network)."""
        self.handle.remove()

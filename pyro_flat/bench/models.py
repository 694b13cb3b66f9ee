"""The harness's model builders: a :class:`~pyro_flat.bench.RunConfig` and a dataset turned into a Bayesian network
of :mod:`pyro_flat.nn` (``--model NAME``).

A builder is ``build(data, config, *, dropout) -> BayesianClassifier``, registered in :data:`MODELS`; it reads the
architecture's fields of the configuration (``hidden``, ``depth``, ``width``, ``norm``, ``latent``, ``pretrained``,
``prior_scale``, ``packed``) and, data-parallel, makes BatchNorm layers normalise over the global batch. The networks
themselves live in :mod:`pyro_flat.nn`, which knows nothing of the harness; these builders are the harness's side of
that boundary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..data import ClassificationData
from ..distributed import convert_batchnorm
from ..nn import (
    BayesianClassifier,
    BayesianCNN,
    BayesianMLP,
    bayesian_transfer,
    make_bayesian,
    preresnet,
    resnet18,
    wide_resnet,
)
from ..nn.resnets import norm_layer
from .batches import world
from .config import RunConfig

__all__ = [
    "CONV_MODELS",
    "MODELS",
    "build_cnn",
    "build_mlp",
    "build_preresnet",
    "build_resnet18",
    "build_resnet18_imagenet",
    "build_wrn",
]


def build_mlp(data: ClassificationData, config: RunConfig, *, dropout: float) -> BayesianMLP:
    """A :class:`~pyro_flat.nn.BayesianMLP` for ``data`` (inputs flattened), hidden widths ``config.hidden``."""
    in_features = 1
    for s in data.input_shape:
        in_features *= s
    return BayesianMLP(in_features, data.num_classes, config.hidden, prior_scale=config.prior_scale, dropout=dropout,
                       packed=config.packed)


def build_cnn(data: ClassificationData, config: RunConfig, *, dropout: float) -> BayesianCNN:
    """A :class:`~pyro_flat.nn.BayesianCNN` for ``data`` (``config.hidden`` gives the conv channels)."""
    return BayesianCNN(tuple(data.input_shape), data.num_classes, config.hidden, prior_scale=config.prior_scale,
                       dropout=dropout, packed=config.packed)


def _image_channels(data: ClassificationData) -> int:
    if len(data.input_shape) != 3:
        raise ValueError(f"the ResNets need image inputs [C, H, W], got input shape {tuple(data.input_shape)}")
    return data.input_shape[0]


def _bayesian(net: nn.Module, data: ClassificationData, config: RunConfig) -> BayesianClassifier:
    """``net`` with ``config.latent`` weights latent under N(0, prior_scale^2) and the rest learned."""
    if _sync_batchnorm():
        net = _global_batchnorm(net, config)
    return BayesianClassifier(make_bayesian(net, random=config.latent, prior_scale=config.prior_scale,
                                            rest="learned", packed=config.packed), data.num_classes)


def _sync_batchnorm() -> bool:
    """Data-parallel: BatchNorm statistics over the global batch, so that R ranks train as one process with the
    whole batch."""
    return world()[1] > 1


def _global_batchnorm(net: nn.Module, config: RunConfig) -> nn.Module:
    """``net``'s BatchNorm layers over the global batch: torch's ``SyncBatchNorm`` on GPUs, which it needs,
    :class:`~pyro_flat.distributed.GlobalBatchNorm` elsewhere."""
    if torch.device(config.device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(net)
    return convert_batchnorm(net)


def build_resnet18(data: ClassificationData, config: RunConfig, *, dropout: float) -> BayesianClassifier:
    """ResNet-18 with the CIFAR stem (:func:`~pyro_flat.nn.resnet18`; ``width``, ``norm``, ``latent``)."""
    net = resnet18(data.num_classes, width=config.width or 64, norm=config.norm, in_channels=_image_channels(data),
                   dropout=dropout)
    return _bayesian(net, data, config)


def build_preresnet(data: ClassificationData, config: RunConfig, *, dropout: float) -> BayesianClassifier:
    """PreResNet-``depth`` (:func:`~pyro_flat.nn.preresnet`; ``depth`` default 20, ``width`` 16, ``norm``,
    ``latent``)."""
    net = preresnet(config.depth or 20, data.num_classes, width=config.width or 16, norm=config.norm,
                    in_channels=_image_channels(data), dropout=dropout)
    return _bayesian(net, data, config)


def build_wrn(data: ClassificationData, config: RunConfig, *, dropout: float) -> BayesianClassifier:
    """WRN-``depth``-``width`` (:func:`~pyro_flat.nn.wide_resnet`; default 28-10, ``norm``, ``latent``)."""
    net = wide_resnet(config.depth or 28, config.width or 10, data.num_classes, norm=config.norm,
                      in_channels=_image_channels(data), dropout=dropout)
    return _bayesian(net, data, config)


def build_resnet18_imagenet(data: ClassificationData, config: RunConfig, *, dropout: float) -> BayesianClassifier:
    """torchvision's ``resnet18`` (ImageNet stem) for transfer: with ``pretrained`` its weights are read from that
    file (a state dict; nothing is downloaded), a new head is made for the target classes and
    :func:`~pyro_flat.nn.bayesian_transfer` makes ``latent`` (default for transfer: ``"norm_and_head"``) weights
    latent around the pretrained values (prior scale ``prior_scale``, the new head's 1) and freezes the rest."""
    import torchvision

    if dropout > 0:
        raise ValueError("resnet18_imagenet has no dropout layers (MC-Dropout needs a network with dropout)")
    _image_channels(data)
    net = torchvision.models.resnet18(num_classes=1000, norm_layer=norm_layer(config.norm))
    if config.pretrained is not None:
        if config.norm != "batch":
            raise ValueError("the pretrained torchvision ResNet-18 has BatchNorm layers: use norm='batch'")
        state = torch.load(config.pretrained, map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    if _sync_batchnorm():
        net = _global_batchnorm(net, config)
    rest = "frozen" if config.pretrained is not None else "learned"
    return bayesian_transfer(net, data.num_classes, random=config.latent, prior_scale=config.prior_scale,
                             rest=rest, copy=False, packed=config.packed)


MODELS: dict[str, Callable[..., BayesianClassifier]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "resnet18": build_resnet18,
    "preresnet": build_preresnet,
    "wrn": build_wrn,
    "resnet18_imagenet": build_resnet18_imagenet,
}
"""Model builders ``build(data, config, *, dropout)``; all but ``"mlp"`` need unflattened image inputs."""

CONV_MODELS = frozenset(MODELS) - {"mlp"}

"""Registries of the comparison harness: methods, datasets and model builders.

A method issue adds its methods here with :func:`register_method` (in its own module, imported by
:mod:`pyro_flat.bench.methods`) without touching the runner. A method is a function ``fit(problem) -> Posterior``:
it trains on ``problem.data`` with the hyperparameters of ``problem.config`` and returns what the BMA needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..data import VISION_DATASETS, ClassificationData, load_digits, load_mnist1d
from ..data.images import load_vision_data
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
from .config import RunConfig


@dataclass(frozen=True)
class MethodSpec:
    """A registered method.

    :param name: the CLI name (``"vi"``, ``"f_vi"``, ...).
    :param fit: ``fit(problem) -> Posterior``.
    :param description: one line for ``--list`` and the report.
    :param baseline: the name of the non-flat method this one is compared with (``None`` for baselines).
    :param reference: the paper the method comes from.
    :param options: the per-method hyperparameters ``fit`` reads with :meth:`~pyro_flat.bench.problem.Problem.option`
        (``--set NAME.KEY=VALUE``); any other key is refused before a run starts.
    """

    name: str
    fit: Callable
    description: str
    baseline: str | None = None
    reference: str = ""
    options: tuple[str, ...] = ()


METHODS: dict[str, MethodSpec] = {}
DATASETS: dict[str, Callable[..., ClassificationData]] = {
    "digits": load_digits,
    "mnist1d": load_mnist1d,
}
"""Bundled datasets ``load(flatten=...)``; the image datasets of :data:`~pyro_flat.data.VISION_DATASETS` are read
from ``RunConfig.data_root`` by :func:`load_data`."""


def dataset_names() -> list[str]:
    """Every dataset the harness knows: the bundled ones and the image datasets read from a folder."""
    return sorted(DATASETS) + list(VISION_DATASETS)


def load_data(name: str, config: RunConfig) -> ClassificationData:
    """The dataset ``name`` as the run's model needs it (flattened for an MLP), on the CPU in the run's dtype; image
    datasets come from ``config.data_root`` (a :class:`~pyro_flat.data.VisionData`), reduced to ``config.shots``
    examples per class if set."""
    flatten = config.model not in CONV_MODELS
    if name in VISION_DATASETS:
        if config.data_root is None:
            raise ValueError(f"dataset {name!r} is read from a local folder: pass its root (--data-root DIR)")
        data = load_vision_data(name, config.data_root, flatten=flatten, dtype=config.torch_dtype)
    else:
        data = lookup(DATASETS, "dataset", name)(flatten=flatten)
    return data if config.shots is None else data.few_shot(config.shots, seed=0)


def register_method(
    name: str, *, description: str, baseline: str | None = None, reference: str = "", options: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Decorator registering ``fit(problem) -> Posterior`` under ``name``, with the option keys it reads."""

    def decorator(fit: Callable) -> Callable:
        if name in METHODS:
            raise ValueError(f"method {name!r} is already registered")
        METHODS[name] = MethodSpec(name, fit, description, baseline, reference, tuple(options))
        return fit

    return decorator


def check_method_options(options: Mapping[str, Mapping[str, object]]) -> None:
    """Refuse per-method options for an unknown method or with a key the method does not read (a typo would
    otherwise run the default silently), before any run; their values are checked by
    :func:`~pyro_flat.bench.options.check_option_values`.

    :raises ValueError: naming the method, the key and the method's options.
    """
    for method, values in options.items():
        if method not in METHODS:
            raise ValueError(f"options given for unknown method {method!r}; known methods: {', '.join(METHODS)}")
        unknown = sorted(set(values) - set(METHODS[method].options))
        if unknown:
            known = ", ".join(METHODS[method].options) or "none"
            raise ValueError(f"method {method!r} has no option {', '.join(map(repr, unknown))}; its options: {known}")


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
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


def lookup(registry: dict, kind: str, name: str) -> object:
    """``registry[name]`` with an error listing the known names."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(sorted(registry))}")
    return registry[name]

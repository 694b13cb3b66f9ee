"""Hyperparameters of a harness run, with the ``quick`` and ``full`` presets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .._validation import check_int, check_positive, check_real

if TYPE_CHECKING:
    import torch

LATENT_CHOICES = ("all", "norm_and_head", "head")

COMPILE_AUTO_STEPS = 5000
"""Steps of a method from which ``RunConfig(compile=None)`` compiles it on CUDA. On an H200 (ResNet-18, batch 128,
bf16, channels-last) a compiled MAP / VI step took 3.9 / 5.0 ms against 15.1 / 20.7 ms eagerly, after about 30 s of
compilation: repaid after about 2,000-2,700 steps; 5,000 (13 CIFAR-10 epochs at batch 128) leaves a margin for the
flat methods' larger graphs, whose compiled GPU steps are not measured yet."""


@dataclass(frozen=True)
class RunConfig:
    """Shared hyperparameters of every method in a harness run.

    :param model: model builder name (``"mlp"``, ``"cnn"``, ``"resnet18"``, ``"preresnet"``, ``"wrn"``,
        ``"resnet18_imagenet"``; ``python -m pyro_flat list``).
    :param hidden: hidden widths (MLP) or conv channels (CNN).
    :param prior_scale: prior standard deviation of every weight, :math:`p(\\theta)=\\mathcal N(0, s^2 I)`.
    :param num_epochs: passes over the training set (steps = epochs x ceil(N / batch_size)).
    :param batch_size: minibatch size :math:`B` (drawn inside the model by ``pyro.plate(subsample_size=B)`` for tensor
        data, from a ``DataLoader`` for augmented images).
    :param lr: learning rate of the SVI/MAP-based methods: Adam's, or with ``optimizer="sgd"`` the learning rate
        :math:`\\alpha` of SGD on the *mean* loss (the step on Pyro's full-data loss is :math:`\\alpha/N`).
    :param num_bma_samples: posterior draws averaged for prediction (30, as in the F-BNN and SWAG code).
    :param ensemble_size: members of a deep ensemble.
    :param dropout: dropout probability of the MC-Dropout methods.
    :param vi_init_scale: initial standard deviation of the mean-field guides.
    :param lambda_max_draws: posterior draws at which the top Hessian eigenvalue is measured (their mean is
        reported).
    :param lambda_max_points: training points in the loss whose Hessian is measured.
    :param lambda_max_iters: power iterations for :math:`\\lambda_{\\max}`.
    :param device: torch device of the run.
    :param dtype: ``"float32"`` or ``"float64"``.
    :param norm: normalisation of the ResNets, ``"batch"`` or ``"group"``.
    :param depth: depth of ``preresnet`` (20, 56, 164, ...; default 20) or ``wrn`` (default 28).
    :param width: width of ``resnet18`` (first stage, default 64), ``preresnet`` (default 16) or ``wrn`` (the widen
        factor, default 10).
    :param latent: which weights of a ResNet are latent: ``"all"``, ``"norm_and_head"`` or ``"head"`` (the others are
        learned point estimates, or frozen at the pretrained values with ``pretrained``).
    :param pretrained: a file with torchvision ``resnet18`` ImageNet weights (a state dict) for
        ``resnet18_imagenet``; the prior of the latent weights is then centred at them.
    :param optimizer: ``"adam"`` or ``"sgd"`` (with ``momentum``) for the SVI/MAP-based methods.
    :param momentum: SGD momentum.
    :param lr_schedule: ``"constant"`` or ``"cosine"`` (from ``lr`` to 0 over each training phase).
    :param data_root: folder of the image datasets (CIFAR-10/100, SVHN, MNIST, FashionMNIST).
    :param augment: random crops and flips for image data (minibatches from a ``DataLoader``); without it image data
        are used like tensor data (in-model subsampling).
    :param shots: keep only this many training examples per class (few-shot transfer); ``None`` keeps all.
    :param num_workers: ``DataLoader`` workers for augmented images (the batches do not depend on it).
    :param precision: ``"float32"`` or ``"bf16"`` (the network's forward pass under ``torch.autocast``; the
        objectives' algebra stays in ``dtype``).
    :param channels_last: channels-last memory format for the network and its image inputs.
    :param packed: every latent weight of the network in one sample site, viewed into the parameters
        (:func:`~pyro_flat.nn.pack_latents`; default): a step is a few tensor operations per site instead of a few per
        weight tensor, the same posterior and objectives; ``False`` gives one site per weight tensor.
    :param compile: train every method through its compiled step (``JitTensorTrace_ELBO`` for the non-flat bases,
        ``JitSharpnessAwareELBO``, ``JitKLBallELBO``, ``jit_compile=True``; CUDA graphs on a GPU) with ``True``, eagerly
        with ``False``; ``None`` (default): compiled on CUDA for a method of at least :data:`COMPILE_AUTO_STEPS`
        steps, where the steps saved repay the compilation (``docs/speed.md``), eager otherwise (on a CPU a
        compilation takes minutes and saves little).
    :param options: per-method overrides, e.g. ``{"f_vi": {"rho": 0.1}}``; read with ``Problem.option``.
    """

    model: str = "mlp"
    hidden: tuple[int, ...] = (256, 256)
    prior_scale: float = 1.0
    num_epochs: int = 100
    batch_size: int = 128
    lr: float = 1e-3
    num_bma_samples: int = 30
    ensemble_size: int = 5
    dropout: float = 0.1
    vi_init_scale: float = 1e-3
    lambda_max_draws: int = 3
    lambda_max_points: int = 512
    lambda_max_iters: int = 30
    device: str = "cpu"
    dtype: str = "float32"
    norm: str = "batch"
    depth: int | None = None
    width: int | None = None
    latent: str = "all"
    pretrained: str | None = None
    optimizer: str = "adam"
    momentum: float = 0.9
    lr_schedule: str = "constant"
    data_root: str | None = None
    augment: bool = True
    shots: int | None = None
    num_workers: int = 0
    precision: str = "float32"
    channels_last: bool = False
    packed: bool = True
    compile: bool | None = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive_ints = ("num_epochs", "batch_size", "num_bma_samples", "ensemble_size", "lambda_max_draws",
                         "lambda_max_points", "lambda_max_iters")
        for name in positive_ints:
            check_int(getattr(self, name), name, owner="RunConfig")
        for name in ("prior_scale", "lr", "vi_init_scale"):
            check_positive(getattr(self, name), name, owner="RunConfig")
        check_real(self.dropout, "dropout", low=0, high=1, high_open=True, owner="RunConfig")
        check_real(self.momentum, "momentum", low=0, high=1, high_open=True, owner="RunConfig")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"RunConfig.dtype must be 'float32' or 'float64', got {self.dtype!r}")
        choices = {"norm": ("batch", "group"), "latent": LATENT_CHOICES, "optimizer": ("adam", "sgd"),
                   "lr_schedule": ("constant", "cosine"), "precision": ("float32", "bf16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"RunConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.compile not in (True, False, None):
            raise ValueError(f"RunConfig.compile must be True, False or None (compiled on CUDA for long runs), got "
                             f"{self.compile!r}")
        for name in ("depth", "width", "shots"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, owner="RunConfig")
        check_int(self.num_workers, "num_workers", minimum=0, owner="RunConfig")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: the command line reads presets without importing torch

        return getattr(torch, self.dtype)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, RunConfig] = {
    # a few minutes for every registered method on one dataset and one seed on 2 CPU cores
    "quick": RunConfig(num_epochs=30, num_bma_samples=10, ensemble_size=3, lambda_max_draws=2, lambda_max_iters=20),
    # the configuration behind the committed result tables
    "full": RunConfig(),
}

r"""The CIFAR networks of the seed papers as plain torch modules, each with BatchNorm or GroupNorm.

* :func:`resnet18` — ResNet-18 [1] with the CIFAR stem (a 3x3 stride-1 first convolution, no max-pool), built from
  torchvision's ``BasicBlock``; with the default width its modules have torchvision's names (``conv1``, ``bn1``,
  ``layer1.0.conv1``, ..., ``fc``). Used by bSAM, Entropy-MCMC and SA-BMA.
* :func:`preresnet` — the pre-activation ResNet [2] of SWA/SWAG and Flat Seeking BNNs: depth 20, 56, ... (basic
  blocks, ``(depth - 2) / 6`` per stage) or 164, ... (bottleneck blocks, ``(depth - 2) / 9`` per stage).
* :func:`wide_resnet` — WRN-depth-k [3] (default WRN-28-10): pre-activation basic blocks, ``(depth - 4) / 6`` per
  stage, widths ``16k, 32k, 64k``.

``norm="batch"`` gives ``BatchNorm2d`` (refresh its statistics per posterior draw,
:func:`~pyro_flat.nn.refresh_batchnorm`), ``norm="group"`` ``GroupNorm`` with ``gcd(32, channels)`` groups (no
running statistics: nothing to refresh, and a perturbed or sampled network normalises consistently). ``width``
scales every layer's channels (ResNet-18: the first stage's width, 64 by default; PreResNet: 16); small widths make
the networks cheap enough to test. ``dropout`` (for MC-Dropout) sits inside every residual block, between its
convolutions, as in WRN [3] (ResNet-18: before the head). Convolutions start from Kaiming-normal weights (fan-out,
as torchvision), normalisation layers at weight 1, bias 0.

Turn any of them Bayesian with :func:`~pyro_flat.nn.make_bayesian` (or :func:`~pyro_flat.nn.bayesian_network`).

References:
    [1] `Deep Residual Learning for Image Recognition`, Kaiming He, Xiangyu Zhang, Shaoqing Ren, Jian Sun (CVPR 2016)
    [2] `Identity Mappings in Deep Residual Networks`, Kaiming He, Xiangyu Zhang, Shaoqing Ren, Jian Sun (ECCV 2016)
    [3] `Wide Residual Networks`, Sergey Zagoruyko, Nikos Komodakis (BMVC 2016), arXiv:1605.07146
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor, nn

from .._validation import check_int, check_real

__all__ = ["NORMS", "norm_layer", "preresnet", "resnet18", "wide_resnet"]

NORMS = ("batch", "group")


def norm_layer(norm: str, groups: int = 32) -> Callable[[int], nn.Module]:
    """``channels -> normalisation layer``: ``"batch"`` (``BatchNorm2d``) or ``"group"`` (``GroupNorm`` with
    ``gcd(groups, channels)`` groups)."""
    if norm == "batch":
        return nn.BatchNorm2d
    if norm == "group":
        return lambda channels: nn.GroupNorm(math.gcd(groups, channels), channels)
    raise ValueError(f"`norm` must be one of {NORMS}, got {norm!r}")


def _check_dropout(dropout: float) -> float:
    return check_real(dropout, "dropout", low=0, high=1, high_open=True)


def _init(net: nn.Module) -> nn.Module:
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return net


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class _Head(nn.Sequential):
    """Global average pool, flatten, (dropout,) linear."""

    def __init__(self, channels: int, num_classes: int, dropout: float = 0.0) -> None:
        layers: list[nn.Module] = [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        super().__init__(*layers, nn.Linear(channels, num_classes))


class ResNet(nn.Module):
    """ResNet-18 with the CIFAR stem (see :func:`resnet18`); the attributes are torchvision's."""

    def __init__(self, num_classes: int, width: int, norm: str, in_channels: int, dropout: float) -> None:
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        make_norm = norm_layer(norm)
        self.conv1 = _conv3x3(in_channels, width)
        self.bn1 = make_norm(width)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], width
        for stage in range(4):
            cout, stride = width * 2**stage, 1 if stage == 0 else 2
            blocks = []
            for b in range(2):
                downsample = None
                if b == 0 and (stride != 1 or cin != cout):
                    downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), make_norm(cout))
                blocks.append(BasicBlock(cin, cout, stride if b == 0 else 1, downsample, norm_layer=make_norm))
                cin = cout
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.dropout(self.avgpool(x).flatten(1)))


def resnet18(
    num_classes: int = 10, *, width: int = 64, norm: str = "batch", in_channels: int = 3, dropout: float = 0.0
) -> ResNet:
    """ResNet-18 with the CIFAR stem: 3x3 stride-1 first convolution, no max-pool, four stages of two basic blocks
    with ``width, 2 width, 4 width, 8 width`` channels (11.2 M parameters for 10 classes at width 64).

    :param num_classes: outputs of the head.
    :param width: channels of the first stage (default 64, the standard network).
    :param norm: ``"batch"`` or ``"group"``.
    :param in_channels: input channels (3 for CIFAR, 1 for MNIST).
    :param dropout: dropout probability before the head (default 0).
    """
    check_int(num_classes, "num_classes")
    check_int(width, "width")
    check_int(in_channels, "in_channels")
    return _init(ResNet(num_classes, width, norm, in_channels, _check_dropout(dropout)))


class PreActBlock(nn.Module):
    """A pre-activation basic block: norm-ReLU-conv3x3-(dropout)-norm-ReLU-conv3x3, plus the (projected) input."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, make_norm: Callable, dropout: float) -> None:
        super().__init__()
        self.bn1, self.conv1 = make_norm(cin), _conv3x3(cin, planes, stride)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.bn2, self.conv2 = make_norm(planes), _conv3x3(planes, planes)
        self.shortcut = None
        if stride != 1 or cin != planes:
            self.shortcut = nn.Conv2d(cin, planes, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.relu(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.dropout(nn.functional.relu(self.bn2(self.conv1(out))))
        return self.conv2(out) + shortcut


class PreActBottleneck(nn.Module):
    """A pre-activation bottleneck: norm-ReLU-conv1x1, norm-ReLU-conv3x3, (dropout,) norm-ReLU-conv1x1 (x4 width)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, make_norm: Callable, dropout: float) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.bn1, self.conv1 = make_norm(cin), nn.Conv2d(cin, planes, 1, bias=False)
        self.bn2, self.conv2 = make_norm(planes), _conv3x3(planes, planes, stride)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.bn3, self.conv3 = make_norm(planes), nn.Conv2d(planes, cout, 1, bias=False)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.relu(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.dropout(self.conv2(nn.functional.relu(self.bn2(out))))
        return self.conv3(nn.functional.relu(self.bn3(out))) + shortcut


class PreActResNet(nn.Module):
    """Stem convolution, three stages of pre-activation blocks, final norm-ReLU, head (see :func:`preresnet` and
    :func:`wide_resnet`)."""

    def __init__(
        self,
        block: type[PreActBlock] | type[PreActBottleneck],
        blocks_per_stage: int,
        widths: tuple[int, int, int, int],
        num_classes: int,
        norm: str,
        in_channels: int,
        dropout: float,
    ) -> None:
        super().__init__()
        make_norm = norm_layer(norm)
        self.conv1 = _conv3x3(in_channels, widths[0])
        stages, cin = [], widths[0]
        for stage, planes in enumerate(widths[1:]):
            layers = []
            for b in range(blocks_per_stage):
                layers.append(block(cin, planes, 2 if stage > 0 and b == 0 else 1, make_norm, dropout))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = make_norm(cin)
        self.head = _Head(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return self.head(nn.functional.relu(self.bn(x)))


def preresnet(
    depth: int = 164,
    num_classes: int = 10,
    *,
    width: int = 16,
    norm: str = "batch",
    in_channels: int = 3,
    dropout: float = 0.0,
) -> PreActResNet:
    """PreResNet-``depth``: basic blocks when ``depth < 44`` or ``(depth - 2) % 9 != 0`` (``depth = 6n + 2``: 20, 32,
    56, 110), bottleneck blocks otherwise (``depth = 9n + 2``: 164 — 1.7 M parameters for 10 classes). Stage widths
    ``width, 2 width, 4 width`` (times 4 after a bottleneck).

    :param depth: 20, 56, 110, 164, ...
    :param num_classes: outputs of the head.
    :param width: channels of the stem and first stage (default 16).
    :param norm: ``"batch"`` or ``"group"``.
    :param in_channels: input channels.
    :param dropout: dropout probability inside every block (the PreResNet-164-Drop of Flat Seeking BNNs uses 0.01).
    """
    check_int(depth, "depth", minimum=8)
    check_int(width, "width")
    if depth >= 44 and (depth - 2) % 9 == 0:
        block, n = PreActBottleneck, (depth - 2) // 9
    elif (depth - 2) % 6 == 0:
        block, n = PreActBlock, (depth - 2) // 6
    else:
        raise ValueError(f"PreResNet `depth` must be 6n + 2 (basic blocks) or 9n + 2 >= 44 (bottlenecks), got {depth}")
    widths = (width, width, 2 * width, 4 * width)
    return _init(PreActResNet(block, n, widths, num_classes, norm, in_channels, _check_dropout(dropout)))


def wide_resnet(
    depth: int = 28,
    widen_factor: int = 10,
    num_classes: int = 10,
    *,
    norm: str = "batch",
    in_channels: int = 3,
    dropout: float = 0.0,
) -> PreActResNet:
    """WRN-``depth``-``widen_factor`` (default WRN-28-10, 36.5 M parameters for 10 classes): a 16-channel stem and
    three stages of ``(depth - 4) / 6`` pre-activation basic blocks with ``16k, 32k, 64k`` channels.

    :param depth: ``6n + 4`` (10, 16, 28, 40, ...).
    :param widen_factor: :math:`k`.
    :param num_classes: outputs of the head.
    :param norm: ``"batch"`` or ``"group"``.
    :param in_channels: input channels.
    :param dropout: dropout probability between the two convolutions of every block (WRN's; Flat Seeking BNNs'
        WRN-28-10-Drop uses 0.05).
    """
    check_int(depth, "depth", minimum=10)
    check_int(widen_factor, "widen_factor")
    if (depth - 4) % 6:
        raise ValueError(f"WRN `depth` must be 6n + 4 (10, 16, 28, 40, ...), got {depth}")
    k = widen_factor
    widths = (16, 16 * k, 32 * k, 64 * k)
    return _init(PreActResNet(PreActBlock, (depth - 4) // 6, widths, num_classes, norm, in_channels,
                              _check_dropout(dropout)))

"""The CIFAR networks: sizes of the published architectures, torchvision's layout, normalisation variants, dropout,
and the three choices of latent parameters."""

from __future__ import annotations

import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_flat.infer.util import latent_sites
from pyro_flat.nn import BayesianClassifier, make_bayesian, preresnet, resnet18, wide_resnet

torchvision = pytest.importorskip("torchvision")


def _count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_parameter_counts_of_the_published_networks():
    # the sizes quoted for these architectures on CIFAR-10 (ResNet-18 with a 3x3 stem 11.17 M, PreResNet-164 1.7 M,
    # PreResNet-20/56 0.27/0.59 M, WRN-28-10 36.5 M); built on the meta device (no memory, no initialisation cost)
    with torch.device("meta"):
        assert _count(resnet18()) == 11_173_962
        assert _count(preresnet(164)) == 1_703_258
        assert _count(preresnet(20)) == 272_282
        assert _count(preresnet(56)) == 590_426
        assert _count(wide_resnet(28, 10)) == 36_479_194


def test_resnet18_is_torchvisions_with_the_cifar_stem():
    ours, theirs = resnet18(100), torchvision.models.resnet18(num_classes=100)
    shapes = {k: v.shape for k, v in ours.state_dict().items()}
    expected = {k: v.shape for k, v in theirs.state_dict().items()}
    assert shapes.pop("conv1.weight") == (64, 3, 3, 3) and expected.pop("conv1.weight") == (64, 3, 7, 7)
    assert shapes == expected  # every other tensor has torchvision's name and shape: its weights load
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if k != "conv1.weight"}, strict=False)
    assert torch.equal(ours.layer3[1].conv2.weight, theirs.layer3[1].conv2.weight)
    assert not any(isinstance(m, nn.MaxPool2d) for m in ours.modules())
    # 32x32 inputs keep 32x32 in the first stage (stride-1 stem, no max-pool)
    features = ours.layer1(ours.relu(ours.bn1(ours.conv1(torch.randn(1, 3, 32, 32)))))
    assert features.shape == (1, 64, 32, 32)


@pytest.mark.parametrize("build", [
    lambda norm: resnet18(7, width=4, norm=norm),
    lambda norm: preresnet(20, 7, width=4, norm=norm),
    lambda norm: preresnet(47, 7, width=2, norm=norm),  # 9n + 2: bottlenecks
    lambda norm: wide_resnet(10, 2, 7, norm=norm),
])
@pytest.mark.parametrize("norm", ["batch", "group"])
def test_forward_shapes_and_normalisation_layers(build, norm):
    net = build(norm)
    out = net(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 7)
    kinds = {type(m) for m in net.modules()}
    if norm == "batch":
        assert nn.BatchNorm2d in kinds and nn.GroupNorm not in kinds
    else:
        assert nn.GroupNorm in kinds and nn.BatchNorm2d not in kinds
        for m in net.modules():
            if isinstance(m, nn.GroupNorm):
                assert m.num_channels % m.num_groups == 0 and m.num_groups == min(32, m.num_channels)


def test_grey_inputs_and_dropout():
    net = wide_resnet(10, 1, 10, in_channels=1, dropout=0.3)
    assert sum(isinstance(m, nn.Dropout) for m in net.modules()) == 3  # one per block, one block per stage
    net.train()
    x = torch.randn(4, 1, 28, 28)
    assert not torch.equal(net(x), net(x))  # dropout active in train mode
    net.eval()
    assert torch.equal(net(x), net(x))
    assert sum(isinstance(m, nn.Dropout) for m in resnet18(width=4, dropout=0.1).modules()) == 1


@pytest.mark.parametrize("call, match", [
    (lambda: preresnet(21), "6n \\+ 2"),
    (lambda: wide_resnet(27), "6n \\+ 4"),
    (lambda: resnet18(norm="layer"), "`norm` must be one of"),
    (lambda: resnet18(width=0), "`width` must be an int >= 1"),
    (lambda: wide_resnet(dropout=1.0), "`dropout`"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("random, expected", [
    ("all", None),
    ("norm_and_head", {"bn", "head"}),
    ("head", {"head"}),
])
def test_latent_choices(random, expected):
    net = preresnet(20, 5, width=2, norm="group")
    num_params = _count(net)
    model = BayesianClassifier(make_bayesian(net, random=random, rest="learned", packed=False), 5)  # a site a tensor
    x = torch.randn(2, 3, 32, 32)
    latents = latent_sites(poutine.trace(model).get_trace(x, torch.zeros(2, dtype=torch.long)))
    learned = sum(p.numel() for p in model.parameters())
    assert learned + sum(v.numel() for v in latents.values()) == num_params  # every parameter is one or the other
    if expected is None:
        assert learned == 0
        return
    head = {"net.head.2.weight", "net.head.2.bias"}
    if expected == {"head"}:
        assert set(latents) == head
    else:
        norms = {k for k in latents if k not in head}
        assert head < set(latents) and norms
        assert all(isinstance(model.net.get_submodule(k[4:].rsplit(".", 1)[0]), nn.GroupNorm) for k in norms)

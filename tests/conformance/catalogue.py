"""A catalogue of small Pyro model/guide shapes, in the style of Pyro's own tests and examples, and of the torch
networks users bring to :func:`~pyro_flat.nn.make_bayesian`.

Every :class:`Case` is a model with its data, a guide factory and the features it exercises; the conformance tests run
every objective, transform, kernel and post-hoc guide of pyro_flat on every case and record the outcome (pass, clear
refusal, or failure) for the "what works with what" table. Every :class:`NetworkCase` is a torch network (recurrent,
attention, embedding, convolution and normalisation layers, tied weights, the torchvision classifiers) that
``tests/conformance/test_networks.py`` turns Bayesian, per weight tensor and packed, and checks against its
hand-written log joint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoGuideList,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.infer.reparam import LocScaleReparam, TransformReparam
from torch import nn
from torch.distributions.transforms import AffineTransform

from pyro_flat.nn import BayesianMLP

FEATURES = {
    "global": "global latents",
    "local": "local latents",
    "model subsampling": "subsampling in the model",
    "guide subsampling": "subsampling in the guide",
    "nested plates": "nested plates",
    "sequential plates": "sequential plates",
    "positive": "positive latents",
    "simplex": "simplex latents",
    "correlation": "correlation (LKJ Cholesky) latents",
    "scale/mask": "poutine.scale / poutine.mask",
    "obs_mask": "obs_mask imputation",
    "deterministic": "pyro.deterministic",
    "module": "pyro.module networks",
    "hand-written guide": "hand-written guides",
    "AutoGuideList": "AutoGuideList",
    "full-covariance guide": "AutoMultivariateNormal / AutoLowRankMultivariateNormal",
    "point mass": "AutoDelta (point mass)",
    "particles": "num_particles > 1 / vectorize_particles",
    "discrete": "discrete latents",
    "network": "a Bayesian network (BayesianMLP)",
    "recurrent": "make_bayesian: recurrent layers (nn.RNN, nn.LSTM, nn.GRU)",
    "attention": "make_bayesian: attention (nn.MultiheadAttention, nn.TransformerEncoderLayer)",
    "embedding": "make_bayesian: nn.Embedding",
    "convolution": "make_bayesian: 1-D and 3-D convolutions",
    "normalisation": "make_bayesian: LayerNorm, GroupNorm, BatchNorm",
    "tied": "make_bayesian: tied weights (one tensor in several modules)",
    "torchvision": "make_bayesian: torchvision classifiers (ResNet, MobileNet, EfficientNet, ViT)",
}


@dataclass
class Case:
    """One model/guide shape.

    :param name: the case's id.
    :param model: the Pyro model.
    :param guide: builds the guide for the model (a fresh one per call).
    :param args: the model's arguments.
    :param kwargs: the model's keyword arguments.
    :param features: keys of :data:`FEATURES`.
    :param elbo_kwargs: options of the objectives (``num_particles``, ...).
    :param mean_field: whether the guide is mean-field (the mean-field ELBOs apply).
    :param discrete: the model has a discrete latent (every method must refuse it by name).
    """

    name: str
    model: Callable
    guide: Callable[[], Callable]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    features: tuple[str, ...] = ()
    elbo_kwargs: dict = field(default_factory=dict)
    mean_field: bool = True
    discrete: bool = False

    def __repr__(self) -> str:
        return self.name


# the suite runs in float64 (tests/conftest.py): data and networks are created in float64 at import
F64 = torch.float64
torch.manual_seed(0)
X = torch.linspace(-1.0, 1.0, 8, dtype=F64)
Y = 0.7 * X + 0.3 + 0.2 * torch.randn(8, dtype=F64)
LABELS = (X + 0.1 * torch.randn(8, dtype=F64) > 0).to(F64)


def normal_model(x):
    z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([len(x)]).to_event(1))
    pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x)


def normal_guide(x):
    loc = pyro.param("loc", torch.zeros(len(x)))
    scale = pyro.param("scale", torch.ones(len(x)), constraint=dist.constraints.positive)
    pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def linear_regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x + b, sigma), obs=y)


def logistic_regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 2.0))
    b = pyro.sample("b", dist.Normal(0.0, 2.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Bernoulli(logits=w * x + b), obs=y)


SCHOOLS_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=F64)
SCHOOLS_SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=F64)


def eight_schools(sigma, y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", len(sigma)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def local_model(x, subsample_size=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=x[idx])


def local_guide(x, subsample_size=None):
    """A hand-written guide that draws the minibatch itself (the model replays it)."""
    m = pyro.param("m", torch.tensor(0.3))
    loc = pyro.param("loc", torch.zeros(len(x)))
    scale = pyro.param("scale", torch.full((len(x),), 0.8), constraint=dist.constraints.positive)
    pyro.sample("mu", dist.Normal(m, 0.5))
    with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
        pyro.sample("z", dist.Normal(loc[idx], scale[idx]))


GROUPS = torch.randn(3, 4, dtype=F64)


def nested_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", y.shape[0], dim=-2):
        g = pyro.sample("g", dist.Normal(mu, 1.0))
        with pyro.plate("members", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(g, 1.0), obs=y)


def sequential_model(a, b):
    ma = pyro.sample("ma", dist.Normal(0.0, 1.0))
    mb = pyro.sample("mb", dist.Normal(0.0, 1.0))
    with pyro.plate("first", len(a)):
        pyro.sample("a", dist.Normal(ma, 1.0), obs=a)
    with pyro.plate("second", len(b)):
        pyro.sample("b", dist.Normal(mb + ma, 1.0), obs=b)


COUNTS = torch.tensor([2.0, 0.0, 3.0, 1.0, 4.0, 2.0], dtype=F64)


def gamma_poisson(y):
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Poisson(rate), obs=y)


CATEGORIES = torch.tensor([0, 2, 1, 1, 0, 2, 2, 1])


def dirichlet_categorical(y):
    p = pyro.sample("p", dist.Dirichlet(torch.ones(3)))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Categorical(p), obs=y)


VECTORS = torch.randn(10, 3, dtype=F64) @ torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 0.3], [0.0, 0.0, 1.0]], dtype=F64)


def lkj_model(y):
    chol = pyro.sample("chol", dist.LKJCholesky(3, torch.tensor(2.0, dtype=F64)))
    sigma = pyro.sample("sigma", dist.LogNormal(0.0, 0.5).expand([3]).to_event(1))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.MultivariateNormal(torch.zeros(3, dtype=F64), scale_tril=sigma[..., None] * chol), obs=y)


def scaled_masked_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)), poutine.scale(scale=2.0), poutine.mask(mask=x > -0.5):
        pyro.sample("y", dist.Normal(w * x, 0.5), obs=y)


MISSING = torch.tensor([True, True, False, True, True, False, True, True])


def imputation_model(x, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x, 0.5), obs=y, obs_mask=MISSING)


def deterministic_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    mean = pyro.deterministic("mean", w * x)
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(mean, 0.5), obs=y)


FEATURE_NET = nn.Linear(1, 2).to(F64)


def module_model(x, y=None):
    net = pyro.module("features", FEATURE_NET)
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(net(x.unsqueeze(-1)) @ w, 0.5), obs=y)


class AmortisedGuide(nn.Module):
    """A network registered with pyro.module maps each x_i to q(z_i | x_i)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(1, 2).to(F64)

    def forward(self, x, subsample_size=None):
        pyro.module("encoder", self.encoder)
        m = pyro.param("m", torch.tensor(0.3, dtype=F64))
        pyro.sample("mu", dist.Normal(m, 0.5))
        with pyro.plate("data", len(x), subsample_size=subsample_size) as idx:
            out = self.encoder(x[idx].unsqueeze(-1))
            pyro.sample("z", dist.Normal(out[..., 0], nn.functional.softplus(out[..., 1]) + 0.1))


def guide_list(model):
    guide = AutoGuideList(model)
    guide.append(AutoNormal(poutine.block(model, expose=["w", "b"])))
    guide.append(AutoDiagonalNormal(poutine.block(model, expose=["sigma"])))
    return guide


def discrete_model(x):
    c = pyro.sample("c", dist.Bernoulli(0.5))
    pyro.sample("x", dist.Normal(c, 1.0).expand([len(x)]).to_event(1), obs=x)


def discrete_guide(x):
    p = pyro.param("p", torch.tensor(0.5), constraint=dist.constraints.unit_interval)
    pyro.sample("c", dist.Bernoulli(p))


def enumerated_model(x):
    c = pyro.sample("c", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(z + c, 1.0).expand([len(x)]).to_event(1), obs=x)


def enumerated_guide(x):
    pyro.sample("z", dist.Normal(pyro.param("zloc", torch.tensor(0.0)), 1.0))


def centred_regression(x, y=None):
    w = pyro.sample("w", dist.Normal(0.3, 2.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x, 0.5), obs=y)


def transformed_regression(x, y=None):
    w = pyro.sample("w", dist.TransformedDistribution(dist.Normal(0.0, 1.0), [AffineTransform(0.3, 2.0)]))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(w * x, 0.5), obs=y)


def by_hand(latent: str) -> Callable:
    """The two regressions above reparameterised by hand: ``latent ~ N(0, 1)``, ``w = 0.3 + 2 latent`` recorded by
    ``pyro.deterministic`` (the sites and density that ``poutine.reparam`` gives them)."""

    def model(x, y=None):
        z = pyro.sample(latent, dist.Normal(0.0, 1.0))
        w = pyro.deterministic("w", 0.3 + 2.0 * z)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(w * x, 0.5), obs=y)

    return model


REPARAMETERISED = {  # poutine.reparam of a regression, its new latent site
    "LocScaleReparam": (poutine.reparam(centred_regression, config={"w": LocScaleReparam(centered=0.0)}),
                        "w_decentered"),
    "TransformReparam": (poutine.reparam(transformed_regression, config={"w": TransformReparam()}), "w_base"),
}

MLP_X = torch.randn(12, 3, dtype=F64)
MLP_Y = torch.randint(0, 2, (12,))


def _mlp():
    torch.manual_seed(0)
    return BayesianMLP(3, 2, hidden=(4,), dropout=0.1).to(F64)


MLP = _mlp()

CASES = [
    Case("normal/hand-written", normal_model, lambda: normal_guide, (X,),
         features=("global", "hand-written guide")),
    Case("normal/AutoNormal", normal_model, lambda: AutoNormal(normal_model), (X,), features=("global",)),
    Case("linear regression/AutoNormal", linear_regression, lambda: AutoNormal(linear_regression), (X, Y),
         features=("global", "positive")),
    Case("logistic regression/AutoDiagonalNormal", logistic_regression, lambda: AutoDiagonalNormal(logistic_regression),
         (X, LABELS), features=("global",)),
    Case("eight schools/AutoNormal", eight_schools, lambda: AutoNormal(eight_schools), (SCHOOLS_SIGMA, SCHOOLS_Y),
         features=("global", "local", "positive")),
    Case("eight schools/AutoMultivariateNormal", eight_schools, lambda: AutoMultivariateNormal(eight_schools),
         (SCHOOLS_SIGMA, SCHOOLS_Y), features=("global", "local", "positive", "full-covariance guide"),
         mean_field=False),
    Case("local latents/AutoNormal (both subsample)", local_model, lambda: AutoNormal(local_model), (X,),
         {"subsample_size": 3}, features=("local", "model subsampling", "guide subsampling")),
    Case("local latents/hand-written (guide subsamples)", local_model, lambda: local_guide, (X,),
         {"subsample_size": 3}, features=("local", "guide subsampling", "hand-written guide")),
    Case("local latents/amortised", local_model, AmortisedGuide, (X,), {"subsample_size": 3},
         features=("local", "guide subsampling", "module", "hand-written guide")),
    Case("nested plates/AutoNormal", nested_model, lambda: AutoNormal(nested_model), (GROUPS,),
         features=("local", "nested plates")),
    Case("sequential plates/AutoNormal", sequential_model, lambda: AutoNormal(sequential_model), (X, Y),
         features=("global", "sequential plates")),
    Case("gamma-poisson/AutoNormal", gamma_poisson, lambda: AutoNormal(gamma_poisson), (COUNTS,),
         features=("positive",)),
    Case("dirichlet/AutoNormal", dirichlet_categorical, lambda: AutoNormal(dirichlet_categorical), (CATEGORIES,),
         features=("simplex",)),
    Case("LKJ Cholesky/AutoNormal", lkj_model, lambda: AutoNormal(lkj_model), (VECTORS,),
         features=("correlation", "positive")),
    Case("scale and mask/AutoNormal", scaled_masked_model, lambda: AutoNormal(scaled_masked_model), (X, Y),
         features=("scale/mask",)),
    Case("obs_mask imputation/AutoNormal", imputation_model, lambda: AutoNormal(imputation_model), (X, Y),
         features=("obs_mask",)),
    Case("deterministic/AutoNormal", deterministic_model, lambda: AutoNormal(deterministic_model), (X, Y),
         features=("deterministic",)),
    Case("pyro.module in the model/AutoNormal", module_model, lambda: AutoNormal(module_model), (X, Y),
         features=("module",)),
    Case("linear regression/AutoGuideList", linear_regression, lambda: guide_list(linear_regression), (X, Y),
         features=("AutoGuideList", "positive"), mean_field=False),
    Case("linear regression/AutoLowRankMultivariateNormal", linear_regression,
         lambda: AutoLowRankMultivariateNormal(linear_regression, rank=2), (X, Y),
         features=("full-covariance guide", "positive"), mean_field=False),
    Case("linear regression/AutoDelta", linear_regression, lambda: AutoDelta(linear_regression), (X, Y),
         features=("point mass", "positive")),
    Case("normal/AutoNormal, 3 particles", normal_model, lambda: AutoNormal(normal_model), (X,),
         features=("particles",), elbo_kwargs={"num_particles": 3}),
    Case("linear regression/vectorised particles", linear_regression, lambda: AutoNormal(linear_regression), (X, Y),
         features=("particles", "positive"),
         elbo_kwargs={"num_particles": 3, "vectorize_particles": True, "max_plate_nesting": 1}),
    Case("BayesianMLP/AutoNormal", MLP, lambda: AutoNormal(MLP), (MLP_X, MLP_Y), {"subsample_size": 6},
         features=("network", "model subsampling")),
    Case("discrete latent/hand-written", discrete_model, lambda: discrete_guide, (X,),
         features=("discrete", "hand-written guide"), discrete=True),
    Case("enumerated discrete latent", enumerated_model, lambda: enumerated_guide, (X,),
         features=("discrete", "hand-written guide"), discrete=True, elbo_kwargs={"max_plate_nesting": 0}),
]


# ---------------------------------------------------------------------------------------------------------------------
# networks for make_bayesian: each maps its inputs to [batch, classes] logits (BayesianClassifier's likelihood)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class NetworkCase:
    """A torch network a user turns Bayesian with :func:`~pyro_flat.nn.make_bayesian`.

    :param name: the case's id.
    :param build: builds the plain torch network (seeded: the same weights at every call, in the default dtype).
    :param inputs: builds the network's inputs ``x`` (a batch).
    :param num_classes: the number of logits the network returns per example.
    :param features: keys of :data:`FEATURES`.
    :param needs: the optional package the case needs (it is skipped without it).
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], torch.Tensor]
    num_classes: int
    features: tuple[str, ...] = ()
    needs: str | None = None

    def __repr__(self) -> str:
        return self.name


class LastStep(nn.Module):
    """A recurrent layer (batch first) and a linear head on its output at the last time step."""

    def __init__(self, recurrent: nn.RNNBase, classes: int = 3) -> None:
        super().__init__()
        self.recurrent = recurrent
        features = recurrent.proj_size or recurrent.hidden_size
        self.head = nn.Linear(features * (2 if recurrent.bidirectional else 1), classes)

    def forward(self, x):
        return self.head(self.recurrent(x)[0][:, -1])


class SelfAttention(nn.Module):
    """Self-attention over the tokens (batch first), mean-pooled, and a linear head."""

    def __init__(self, dim: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.attention(x, x, x)[0].mean(1))


class Pooled(nn.Module):
    """A module on a batch of tokens (batch first), mean-pooled, and a linear head."""

    def __init__(self, body: nn.Module, dim: int, classes: int = 3) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.body(x).mean(1))


class TiedLanguageModel(nn.Module):
    """Token embeddings, mean-pooled, decoded to the vocabulary by a linear layer whose weight IS the embedding
    matrix (weight tying)."""

    def __init__(self, vocabulary: int = 5, dim: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dim)
        self.decode = nn.Linear(dim, vocabulary)
        self.decode.weight = self.embed.weight

    def forward(self, tokens):
        return self.decode(self.embed(tokens).mean(1))


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded():
        torch.manual_seed(0)
        return build()

    return seeded


def _randn(*shape):
    return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _shared_linear():
    first, second = nn.Linear(3, 3), nn.Linear(3, 2)
    shared = nn.Linear(3, 3)
    first.weight = shared.weight  # first and shared hold one tensor; shared is used twice below
    return nn.Sequential(first, nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(), second)


# torchvision classifiers built without weights, small (imported when built: torchvision is an optional extra)


def _resnet():
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3)  # resnet18's blocks, one per stage


def _mobilenet_v2():
    from torchvision.models import mobilenet_v2

    return mobilenet_v2(num_classes=3, width_mult=0.1)


def _mobilenet_v3_small():
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=3, width_mult=0.25)


def _efficientnet():
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stages = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(6, 3, 2, 8, 16, 1)]  # efficientnet_b0's first two
    return EfficientNet(stages, dropout=0.2, stochastic_depth_prob=0.2, num_classes=3)


def _vit():
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=8, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
                             num_classes=3)


NETWORK_CASES = [
    NetworkCase("nn.LSTM (2 layers, bidirectional)", _seeded(lambda: LastStep(
        nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True))), _randn(4, 5, 3), 3, ("recurrent",)),
    NetworkCase("nn.LSTM (proj_size, no bias)", _seeded(lambda: LastStep(
        nn.LSTM(3, 4, proj_size=2, bias=False, batch_first=True))), _randn(4, 5, 3), 3, ("recurrent",)),
    NetworkCase("nn.GRU", _seeded(lambda: LastStep(nn.GRU(3, 4, batch_first=True))), _randn(4, 5, 3), 3,
                ("recurrent",)),
    NetworkCase("nn.RNN (relu, 2 layers)", _seeded(lambda: LastStep(
        nn.RNN(3, 4, num_layers=2, nonlinearity="relu", batch_first=True))), _randn(4, 5, 3), 3, ("recurrent",)),
    NetworkCase("nn.MultiheadAttention", _seeded(SelfAttention), _randn(4, 5, 4), 3, ("attention",)),
    NetworkCase("nn.TransformerEncoderLayer", _seeded(lambda: Pooled(
        nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True), 4)), _randn(4, 5, 4), 3,
                ("attention", "normalisation")),
    NetworkCase("nn.Embedding, tied decoder", _seeded(TiedLanguageModel),
                lambda: torch.randint(0, 5, (4, 6), generator=torch.Generator().manual_seed(1)), 5,
                ("embedding", "tied")),
    NetworkCase("one nn.Linear in two modules, one used twice", _seeded(_shared_linear), _randn(4, 3), 2, ("tied",)),
    NetworkCase("nn.Conv1d, GroupNorm", _seeded(lambda: nn.Sequential(
        nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 3))),
                _randn(4, 2, 7), 3, ("convolution", "normalisation")),
    NetworkCase("nn.Conv3d, BatchNorm3d", _seeded(lambda: nn.Sequential(
        nn.Conv3d(1, 2, 2), nn.BatchNorm3d(2), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(2, 3))),
                _randn(4, 1, 3, 3, 3), 3, ("convolution", "normalisation")),
    NetworkCase("nn.LayerNorm MLP", _seeded(lambda: nn.Sequential(
        nn.Linear(3, 4), nn.LayerNorm(4), nn.GELU(), nn.Linear(4, 3))), _randn(4, 3), 3, ("normalisation",)),
    NetworkCase("torchvision ResNet", _seeded(_resnet), _randn(4, 3, 32, 32), 3, ("torchvision", "normalisation"),
                needs="torchvision"),
    NetworkCase("torchvision MobileNetV2", _seeded(_mobilenet_v2), _randn(2, 3, 16, 16), 3,
                ("torchvision", "normalisation"), needs="torchvision"),
    NetworkCase("torchvision MobileNetV3-Small", _seeded(_mobilenet_v3_small), _randn(2, 3, 16, 16), 3,
                ("torchvision", "normalisation"), needs="torchvision"),
    NetworkCase("torchvision EfficientNet", _seeded(_efficientnet), _randn(2, 3, 16, 16), 3,
                ("torchvision", "normalisation"), needs="torchvision"),
    NetworkCase("torchvision ViT", _seeded(_vit), _randn(2, 3, 8, 8), 3, ("torchvision", "attention", "normalisation"),
                needs="torchvision"),
]

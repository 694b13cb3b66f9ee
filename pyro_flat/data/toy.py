r"""Toy data and targets with known answers, for tests and tutorials (torch and Pyro only).

* :func:`two_moons` and :func:`heteroscedastic_regression`: small datasets for decision-boundary and
  predictive-uncertainty plots.
* :class:`SharpFlatEnergy`: a 2-D mixture with one sharp and one flat mode, the synthetic target of Entropy-MCMC.
* :class:`BayesianLinearRegression`: a conjugate model with an exact Gaussian posterior.
* :class:`GaussianTarget`: a Gaussian :math:`\mathcal N(\mu, \Sigma)` as a Pyro model.

The Pyro models of the targets give their latent an *improper flat prior* and add the log density with
``pyro.factor``, so the posterior is exactly the target. The flat prior is written
``dist.Normal(0, 1).expand([D]).to_event(1).mask(False)``: its log density is exactly zero (so the factor alone
defines the posterior), yet, unlike ``dist.ImproperUniform``, it can be sampled, which Pyro's initialisation
strategies (``init_to_median``/``init_to_uniform``), ``initialize_model`` (it runs the model once to count plates),
``AutoNormal``/``AutoDelta`` and ``MCMC`` all need.

References:
    * [1] `Entropy-MCMC: Sampling from Flat Basins with Ease`, Bolian Li, Ruqi Zhang (ICLR 2024), arXiv:2310.05401
    * [2] `Pattern Recognition and Machine Learning`, Christopher M. Bishop (Springer 2006), section 3.3,
      ISBN:978-0-387-31073-2
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from .._validation import check_int, check_positive, check_real
from .datasets import ClassificationData, RegressionData

__all__ = [
    "two_moons",
    "heteroscedastic_regression",
    "heteroscedastic_mean",
    "heteroscedastic_noise_std",
    "SharpFlatEnergy",
    "BayesianLinearRegression",
    "GaussianTarget",
]


def _resolve(device: torch.device | str | None, dtype: torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """The requested device (default CPU) and floating dtype (default ``torch.get_default_dtype()``)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"expected dtype to be a floating torch.dtype or None, got {dtype!r}")
    return torch.device("cpu" if device is None else device), torch.get_default_dtype() if dtype is None else dtype


def _flat_prior(dim: int, device: torch.device, dtype: torch.dtype) -> dist.TorchDistribution:
    """An improper flat prior on :math:`\\mathbb R^D` (log density exactly 0) that can still be sampled for init."""
    zeros = torch.zeros(dim, device=device, dtype=dtype)
    return dist.Normal(zeros, torch.ones_like(zeros)).to_event(1).mask(False)


# --------------------------------------------------------------------------------------------------------------------
# datasets


def _moons(num: int, noise: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``num`` two-moons points (float64, CPU), in the construction of ``sklearn.datasets.make_moons``."""
    num_outer = num // 2
    num_inner = num - num_outer
    t_outer = torch.linspace(0, math.pi, num_outer, dtype=torch.float64)
    t_inner = torch.linspace(0, math.pi, num_inner, dtype=torch.float64)
    outer = torch.stack([torch.cos(t_outer), torch.sin(t_outer)], dim=-1)
    inner = torch.stack([1 - torch.cos(t_inner), 0.5 - torch.sin(t_inner)], dim=-1)
    x = torch.cat([outer, inner])
    y = torch.cat([torch.zeros(num_outer, dtype=torch.int64), torch.ones(num_inner, dtype=torch.int64)])
    order = torch.randperm(num, generator=generator)
    x = x[order] + noise * torch.randn(num, 2, generator=generator, dtype=torch.float64)
    return x, y[order]


def two_moons(
    num_data: int = 100,
    *,
    noise: float = 0.1,
    seed: int = 1,
    num_test: int = 500,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ClassificationData:
    r"""Two interleaving half circles in 2-D, 2 classes (the bSAM two-moons demo uses the defaults).

    Class 0 lies on the upper half circle :math:`(\cos t, \sin t)`, class 1 on the lower one
    :math:`(1-\cos t, \tfrac12-\sin t)`, :math:`t\in[0,\pi]` evenly spaced, with ``num_data // 2`` points in class
    0 and the rest in class 1 (the construction of ``sklearn.datasets.make_moons``), shuffled, plus isotropic
    Gaussian noise of standard deviation ``noise``. The test set is drawn the same way with ``num_test`` points and
    fresh noise. Train and test come from one CPU generator seeded with ``seed``; ``x_ood`` is ``None``.

    :param int num_data: the number of training points (at least 2).
    :param float noise: the noise standard deviation (>= 0).
    :param int seed: the seed.
    :param int num_test: the number of test points (at least 2).
    :param device: the device of all tensors (default CPU).
    :param dtype: the floating dtype of the inputs (default ``torch.get_default_dtype()``).
    :returns: the dataset, named ``"two_moons"``, with inputs of shape ``[n, 2]``.
    :rtype: ClassificationData
    """
    owner = "two_moons"
    check_int(num_data, "num_data", minimum=2, owner=owner)
    check_int(num_test, "num_test", minimum=2, owner=owner)
    check_real(noise, "noise", low=0, owner=owner)
    device, dtype = _resolve(device, dtype)
    generator = torch.Generator().manual_seed(seed)
    x_train, y_train = _moons(num_data, noise, generator)
    x_test, y_test = _moons(num_test, noise, generator)
    return ClassificationData(
        name="two_moons",
        x_train=x_train.to(device=device, dtype=dtype),
        y_train=y_train.to(device),
        x_test=x_test.to(device=device, dtype=dtype),
        y_test=y_test.to(device),
        num_classes=2,
    )


def heteroscedastic_mean(x: Tensor) -> Tensor:
    r"""The regression function of :func:`heteroscedastic_regression`: :math:`f(x)=\sin(2x)+0.3\,x`.

    :param Tensor x: inputs of any shape.
    """
    return torch.sin(2 * x) + 0.3 * x


def heteroscedastic_noise_std(x: Tensor) -> Tensor:
    r"""The noise standard deviation of :func:`heteroscedastic_regression`: :math:`\sigma(x)=0.05+0.1\,|x|`.

    :param Tensor x: inputs of any shape.
    """
    return 0.05 + 0.1 * x.abs()


def heteroscedastic_regression(
    num_data: int = 200,
    *,
    seed: int = 0,
    num_test: int = 500,
    test_range: tuple[float, float] = (-5.0, 5.0),
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> RegressionData:
    r"""1-D regression with a gap in the inputs and noise that grows with :math:`|x|`.

    Training inputs are uniform on :math:`[-3,-1]\cup[1,3]` (no data in the gap :math:`(-1,1)`; a fair coin picks
    the side), targets are

    .. math:: y = f(x) + \sigma(x)\,\varepsilon,\quad f(x)=\sin(2x)+0.3\,x,\quad \sigma(x)=0.05+0.1\,|x|,
        \quad \varepsilon\sim\mathcal N(0,1)

    (:func:`heteroscedastic_mean`, :func:`heteroscedastic_noise_std`). Test inputs are ``num_test`` evenly spaced
    points on the wider ``test_range`` with targets drawn the same way, so a good predictive is uncertain in the gap
    and outside :math:`[-3, 3]`. All draws come from one CPU generator seeded with ``seed``.

    :param int num_data: the number of training points.
    :param int seed: the seed.
    :param int num_test: the number of test points.
    :param test_range: the ``(low, high)`` interval of the test grid.
    :type test_range: tuple[float, float]
    :param device: the device of all tensors (default CPU).
    :param dtype: the floating dtype (default ``torch.get_default_dtype()``).
    :returns: the dataset, named ``"heteroscedastic"``, with inputs ``[n, 1]`` and targets ``[n]``.
    :rtype: RegressionData
    """
    owner = "heteroscedastic_regression"
    check_int(num_data, "num_data", owner=owner)
    check_int(num_test, "num_test", owner=owner)
    low, high = test_range
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{owner}: expected test_range = (low, high) with finite low < high, got {test_range!r}")
    device, dtype = _resolve(device, dtype)
    generator = torch.Generator().manual_seed(seed)
    magnitude = 1 + 2 * torch.rand(num_data, generator=generator, dtype=torch.float64)
    sign = torch.where(torch.rand(num_data, generator=generator, dtype=torch.float64) < 0.5, -1.0, 1.0)
    x_train = sign * magnitude
    x_test = torch.linspace(low, high, num_test, dtype=torch.float64)

    def targets(x: Tensor) -> Tensor:
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        return heteroscedastic_mean(x) + heteroscedastic_noise_std(x) * noise

    y_train, y_test = targets(x_train), targets(x_test)
    return RegressionData(
        "heteroscedastic",
        *(t.to(device=device, dtype=dtype) for t in (x_train[:, None], y_train, x_test[:, None], y_test)),
    )


# --------------------------------------------------------------------------------------------------------------------
# targets


class SharpFlatEnergy:
    r"""A two-component Gaussian mixture with a sharp and a flat mode: the synthetic target of Entropy-MCMC [1].

    .. math::
        U(x) = -\log\big[w\,\mathcal N(x; m_s, s_s^2 I) + (1-w)\,\mathcal N(x; m_f, s_f^2 I)\big],
        \qquad p(x) = e^{-U(x)},

    with the defaults :math:`m_s=(-2,0)`, :math:`s_s=0.15`, :math:`m_f=(2,0)`, :math:`s_f=1`, :math:`w=\tfrac12`:
    both modes hold half the mass, but the sharp one is :math:`(1/0.15)^2\approx 44` times higher and narrower. The
    mixture is normalised, so :meth:`log_prob` is exactly :math:`-U`. The dimension :math:`D` is the length of the
    means (2 by default).

    :param sharp_mean: :math:`m_s`, the centre of the sharp component (``sharp_mode``).
    :param float sharp_scale: :math:`s_s > 0`.
    :param flat_mean: :math:`m_f`, the centre of the flat component (``flat_mode``).
    :param float flat_scale: :math:`s_f > 0`.
    :param float sharp_weight: :math:`w \in (0, 1)`, the mass of the sharp component.
    :param device: the device of all tensors (default CPU).
    :param dtype: the floating dtype (default ``torch.get_default_dtype()``).

    ``sharp_mode`` and ``flat_mode`` are the component means; they are the modes of :math:`p` up to a shift of
    order :math:`e^{-8}` for the defaults (each component's density at the other's centre is negligible).
    """

    def __init__(
        self,
        sharp_mean: Sequence[float] | Tensor = (-2.0, 0.0),
        sharp_scale: float = 0.15,
        flat_mean: Sequence[float] | Tensor = (2.0, 0.0),
        flat_scale: float = 1.0,
        sharp_weight: float = 0.5,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        owner = "SharpFlatEnergy"
        device, dtype = _resolve(device, dtype)
        self.sharp_mode = torch.as_tensor(sharp_mean, device=device, dtype=dtype).clone()
        self.flat_mode = torch.as_tensor(flat_mean, device=device, dtype=dtype).clone()
        if self.sharp_mode.dim() != 1 or self.flat_mode.shape != self.sharp_mode.shape:
            raise ValueError(
                f"{owner}: expected sharp_mean and flat_mean to be vectors of one length D, got shapes "
                f"{tuple(self.sharp_mode.shape)} and {tuple(self.flat_mode.shape)}"
            )
        self.sharp_scale = check_positive(sharp_scale, "sharp_scale", owner=owner)
        self.flat_scale = check_positive(flat_scale, "flat_scale", owner=owner)
        self.sharp_weight = check_real(sharp_weight, "sharp_weight", low=0, high=1, low_open=True, high_open=True,
                                       owner=owner)

    @property
    def dim(self) -> int:
        """The dimension :math:`D`."""
        return len(self.sharp_mode)

    @property
    def device(self) -> torch.device:
        """The device of the means."""
        return self.sharp_mode.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the means."""
        return self.sharp_mode.dtype

    def _check_points(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != self.dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"SharpFlatEnergy: expected x of shape [..., {self.dim}], got {shape}")

    def _component_log_probs(self, x: Tensor) -> Tensor:
        """``[..., 2]``: :math:`\\log w + \\log\\mathcal N(x; m_s, s_s^2 I)` and the same for the flat component."""
        self._check_points(x)
        out = []
        for mean, scale, weight in (
            (self.sharp_mode, self.sharp_scale, self.sharp_weight),
            (self.flat_mode, self.flat_scale, 1.0 - self.sharp_weight),
        ):
            squared = ((x - mean) ** 2).sum(-1)
            log_normal = -0.5 * squared / scale**2 - self.dim * (math.log(scale) + 0.5 * math.log(2 * math.pi))
            out.append(math.log(weight) + log_normal)
        return torch.stack(out, dim=-1)

    def potential(self, x: Tensor) -> Tensor:
        """The energy :math:`U(x)`, batched over the leading dimensions of ``x`` (``[..., D] -> [...]``).

        :param Tensor x: points of shape ``[..., D]``.
        """
        return -torch.logsumexp(self._component_log_probs(x), dim=-1)

    def log_prob(self, x: Tensor) -> Tensor:
        """The normalised log density :math:`\\log p(x) = -U(x)`, ``[..., D] -> [...]``.

        :param Tensor x: points of shape ``[..., D]``.
        """
        return -self.potential(x)

    @property
    def mean(self) -> Tensor:
        """The exact mixture mean :math:`w m_s + (1-w) m_f`."""
        w = self.sharp_weight
        return w * self.sharp_mode + (1 - w) * self.flat_mode

    @property
    def covariance(self) -> Tensor:
        """The exact mixture covariance :math:`\\sum_k w_k (s_k^2 I + m_k m_k^T) - \\bar m \\bar m^T`."""
        w = self.sharp_weight
        eye = torch.eye(self.dim, device=self.device, dtype=self.dtype)
        second = w * (self.sharp_scale**2 * eye + torch.outer(self.sharp_mode, self.sharp_mode)) + (1 - w) * (
            self.flat_scale**2 * eye + torch.outer(self.flat_mode, self.flat_mode)
        )
        return second - torch.outer(self.mean, self.mean)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """Exact draws from :math:`p`: pick the sharp component with probability :math:`w`, then draw from it.

        :param int num_samples: the number of draws.
        :param generator: a generator on the energy's device (``None``: torch's global generator).
        :type generator: torch.Generator or None
        :returns: samples of shape ``[num_samples, D]``.
        """
        check_int(num_samples, "num_samples", owner="SharpFlatEnergy.sample")
        options = {"generator": generator, "device": self.device, "dtype": self.dtype}
        is_sharp = torch.rand(num_samples, 1, **options) < self.sharp_weight
        noise = torch.randn(num_samples, self.dim, **options)
        sharp = self.sharp_mode + self.sharp_scale * noise
        flat = self.flat_mode + self.flat_scale * noise
        return torch.where(is_sharp, sharp, flat)

    def in_flat_mode(self, x: Tensor) -> Tensor:
        r"""Whether each point is closer to the flat component than to the sharp one, in Mahalanobis distance.

        The rule is :math:`\|x-m_f\|/s_f < \|x-m_s\|/s_s` (each distance in units of its component's scale). It
        ignores the weights, so it marks the basin a chain sits in rather than the more probable component; with the
        defaults it labels a draw from the sharp component "flat" only when the draw is more than about 4 sharp
        standard deviations out (probability :math:`\approx e^{-8}`).

        :param Tensor x: points of shape ``[..., D]``.
        :returns: a bool tensor of shape ``[...]``.
        """
        self._check_points(x)
        to_flat = (x - self.flat_mode).norm(dim=-1) / self.flat_scale
        to_sharp = (x - self.sharp_mode).norm(dim=-1) / self.sharp_scale
        return to_flat < to_sharp

    def model(self) -> Tensor:
        """A Pyro model whose posterior is exactly :math:`p`: a latent ``"x"`` of shape ``[D]`` with a flat prior
        (see the module docstring) and ``pyro.factor("energy", -U(x))``.

        :returns: the latent ``x``.
        """
        x = pyro.sample("x", _flat_prior(self.dim, self.device, self.dtype))
        pyro.factor("energy", -self.potential(x))
        return x


@dataclass(eq=False)
class BayesianLinearRegression:
    r"""Bayesian linear regression without bias, a conjugate model with an exact Gaussian posterior [2].

    .. math::
        w \sim \mathcal N(0, \alpha^{-1} I_D), \qquad y_n \mid w \sim \mathcal N(x_n^\top w, \beta^{-1}),

    whose posterior is :math:`\mathcal N(\mu, \Sigma)` with

    .. math:: \Sigma = (\alpha I + \beta X^\top X)^{-1}, \qquad \mu = \beta\, \Sigma X^\top y.

    :param Tensor x: inputs :math:`X`, shape ``[N, D]``.
    :param Tensor y: targets, shape ``[N]``.
    :param float alpha: the prior precision :math:`\alpha > 0`.
    :param float beta: the noise precision :math:`\beta > 0`.
    :param true_weights: the weights the data were generated with (set by :meth:`generate`), else ``None``.
    :type true_weights: Tensor or None
    """

    x: Tensor
    y: Tensor
    alpha: float = 1.0
    beta: float = 25.0
    true_weights: Tensor | None = None

    def __post_init__(self) -> None:
        owner = "BayesianLinearRegression"
        if not isinstance(self.x, Tensor) or not self.x.is_floating_point() or self.x.dim() != 2:
            raise ValueError(f"{owner}: expected x to be a floating tensor of shape [N, D], got {self.x!r}")
        if not isinstance(self.y, Tensor) or self.y.shape != self.x.shape[:1] or self.y.dtype != self.x.dtype:
            raise ValueError(f"{owner}: expected y of shape [N] = [{len(self.x)}] and dtype {self.x.dtype}")
        if self.y.device != self.x.device:
            raise ValueError(f"{owner}: expected y on x's device {self.x.device}, got {self.y.device}")
        self.alpha = check_positive(self.alpha, "alpha", owner=owner)
        self.beta = check_positive(self.beta, "beta", owner=owner)

    @classmethod
    def generate(
        cls,
        num_data: int,
        dim: int,
        *,
        alpha: float = 1.0,
        beta: float = 25.0,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> BayesianLinearRegression:
        r"""Synthetic data from the model: :math:`X_{nd}\sim\mathcal N(0,1)`, :math:`w\sim\mathcal N(0,\alpha^{-1}I)`,
        :math:`y = Xw + \beta^{-1/2}\varepsilon`, from a CPU generator seeded with ``seed``.

        :param int num_data: :math:`N`.
        :param int dim: :math:`D`.
        :param float alpha: the prior precision.
        :param float beta: the noise precision.
        :param int seed: the seed.
        :param device: the device (default CPU).
        :param dtype: the floating dtype (default ``torch.get_default_dtype()``).
        """
        owner = "BayesianLinearRegression.generate"
        check_int(num_data, "num_data", owner=owner)
        check_int(dim, "dim", owner=owner)
        alpha, beta = check_positive(alpha, "alpha", owner=owner), check_positive(beta, "beta", owner=owner)
        device, dtype = _resolve(device, dtype)
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(num_data, dim, generator=generator, dtype=torch.float64)
        w = alpha**-0.5 * torch.randn(dim, generator=generator, dtype=torch.float64)
        y = x @ w + beta**-0.5 * torch.randn(num_data, generator=generator, dtype=torch.float64)
        x, y, w = (t.to(device=device, dtype=dtype) for t in (x, y, w))
        return cls(x, y, alpha, beta, true_weights=w)

    @property
    def num_data(self) -> int:
        """:math:`N`."""
        return len(self.x)

    @property
    def dim(self) -> int:
        """:math:`D`."""
        return self.x.shape[1]

    def _posterior(self) -> tuple[Tensor, Tensor]:
        x, y = self.x.double(), self.y.double()
        precision = self.alpha * torch.eye(self.dim, dtype=torch.float64, device=x.device) + self.beta * x.T @ x
        covariance = torch.cholesky_inverse(torch.linalg.cholesky(precision))
        mean = self.beta * covariance @ (x.T @ y)
        return mean.to(self.x.dtype), covariance.to(self.x.dtype)

    @property
    def posterior_mean(self) -> Tensor:
        r"""The exact posterior mean :math:`\mu = \beta\Sigma X^\top y` (computed in float64, returned in x's dtype)."""
        return self._posterior()[0]

    @property
    def posterior_covariance(self) -> Tensor:
        r"""The exact posterior covariance :math:`\Sigma = (\alpha I + \beta X^\top X)^{-1}` (computed in float64)."""
        return self._posterior()[1]

    def model(self, x: Tensor | None = None, y: Tensor | None = None, subsample_size: int | None = None) -> Tensor:
        """The Pyro model: latent ``"w"`` (``[D]``) and observations ``"obs"`` in a ``pyro.plate("data", N)``.

        With ``subsample_size=B`` the plate draws ``B`` indices per call and Pyro scales the likelihood by
        :math:`N/B`. The mean is computed as ``(x[idx] * w).sum(-1)`` so that a batched ``w`` (vectorised particles,
        ``Predictive(parallel=True)``) broadcasts against the plate.

        :param x: inputs ``[N', D]`` (default: the stored ``x``).
        :type x: Tensor or None
        :param y: targets ``[N']``, or ``None`` to sample them; defaults to the stored ``y`` only when ``x`` is
            also omitted.
        :type y: Tensor or None
        :param subsample_size: the minibatch size ``B`` (``None``: all data).
        :type subsample_size: int or None
        :returns: the sampled weights ``w``.
        """
        if x is None:
            x = self.x
            y = self.y if y is None else y
        scale = torch.full((self.dim,), self.alpha**-0.5, device=x.device, dtype=x.dtype)
        w = pyro.sample("w", dist.Normal(torch.zeros_like(scale), scale).to_event(1))
        with pyro.plate("data", len(x), subsample_size=subsample_size, device=x.device) as idx:
            # the noise scale made on the device (a Python float would be copied from the host at every call)
            noise = torch.full((), self.beta**-0.5, device=x.device, dtype=x.dtype)
            pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), noise), obs=None if y is None else y[idx])
        return w


class GaussianTarget:
    r"""A Gaussian target :math:`\mathcal N(\mu, \Sigma)` for sampler tests, with a Pyro model.

    :param mean: :math:`\mu`, shape ``[D]``.
    :param covariance: :math:`\Sigma`, symmetric positive definite, shape ``[D, D]``.
    :param device: the device (default: ``mean``'s if it is a tensor, else CPU).
    :param dtype: the floating dtype (default: ``mean``'s if it is a floating tensor, else
        ``torch.get_default_dtype()``).
    """

    def __init__(
        self,
        mean: Sequence[float] | Tensor,
        covariance: Sequence[Sequence[float]] | Tensor,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        owner = "GaussianTarget"
        if isinstance(mean, Tensor):
            device = mean.device if device is None else device
            dtype = mean.dtype if dtype is None and mean.is_floating_point() else dtype
        device, dtype = _resolve(device, dtype)
        self.mean = torch.as_tensor(mean, device=device, dtype=dtype).clone()
        self.covariance = torch.as_tensor(covariance, device=device, dtype=dtype).clone()
        dim = len(self.mean) if self.mean.dim() == 1 else -1
        if dim < 1 or self.covariance.shape != (dim, dim):
            raise ValueError(
                f"{owner}: expected mean of shape [D] and covariance of shape [D, D], got "
                f"{tuple(self.mean.shape)} and {tuple(self.covariance.shape)}"
            )
        if not torch.allclose(self.covariance, self.covariance.T):
            raise ValueError(f"{owner}: expected a symmetric covariance")
        scale_tril, info = torch.linalg.cholesky_ex(self.covariance)
        if int(info) != 0:
            raise ValueError(f"{owner}: expected a positive definite covariance (Cholesky failed)")
        self.scale_tril = scale_tril
        self._distribution = dist.MultivariateNormal(self.mean, scale_tril=scale_tril)

    @property
    def dim(self) -> int:
        """:math:`D`."""
        return len(self.mean)

    @property
    def precision(self) -> Tensor:
        r""":math:`\Sigma^{-1}`."""
        return torch.cholesky_inverse(self.scale_tril)

    def log_prob(self, theta: Tensor) -> Tensor:
        """:math:`\\log\\mathcal N(\\theta; \\mu, \\Sigma)`, ``[..., D] -> [...]``.

        :param Tensor theta: points of shape ``[..., D]``.
        """
        if not isinstance(theta, Tensor) or theta.dim() < 1 or theta.shape[-1] != self.dim:
            shape = tuple(theta.shape) if isinstance(theta, Tensor) else type(theta).__name__
            raise ValueError(f"GaussianTarget: expected theta of shape [..., {self.dim}], got {shape}")
        return self._distribution.log_prob(theta)

    def potential(self, theta: Tensor) -> Tensor:
        """:math:`U(\\theta) = -\\log\\mathcal N(\\theta; \\mu, \\Sigma)`.

        :param Tensor theta: points of shape ``[..., D]``.
        """
        return -self.log_prob(theta)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """Exact draws :math:`\\mu + L\\varepsilon`, ``[num_samples, D]``.

        :param int num_samples: the number of draws.
        :param generator: a generator on the target's device (``None``: torch's global generator).
        :type generator: torch.Generator or None
        """
        check_int(num_samples, "num_samples", owner="GaussianTarget.sample")
        noise = torch.randn(num_samples, self.dim, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.mean + noise @ self.scale_tril.T

    def model(self) -> Tensor:
        """A Pyro model whose posterior is exactly :math:`\\mathcal N(\\mu, \\Sigma)`: a latent ``"theta"`` of shape
        ``[D]`` with a flat prior (see the module docstring) and ``pyro.factor("log_density", log N(theta))``.

        :returns: the latent ``theta``.
        """
        theta = pyro.sample("theta", _flat_prior(self.dim, self.mean.device, self.mean.dtype))
        pyro.factor("log_density", self.log_prob(theta))
        return theta

r"""Turning a torch network into a (partly) Bayesian :class:`~pyro.nn.PyroModule`.

:func:`make_bayesian` converts an ``nn.Module`` in place with :func:`pyro.nn.module.to_pyro_module_` and replaces a
chosen subset of its parameters :math:`\theta_j` by :class:`~pyro.nn.PyroSample` latent sites with the Gaussian prior

.. math:: p(\theta_j) = \mathcal N(\theta_j;\ m_j,\ s^2 I),

where :math:`s` is ``prior_scale`` and :math:`m_j` is zero (``prior_loc="zero"``) or the parameter's current value
(``prior_loc="current"``, the natural prior for transfer learning from a pretrained network). The parameters that
are not random are either frozen (turned into buffers, so no Pyro optimiser touches them) or left as learnable
``pyro.param`` sites.

Prior locations and scales live in buffers, so ``model.to(device)`` moves the prior with the network. The network's
own initialisation is kept (a buffer per random parameter) and exposed through :func:`init_to_network`, so guides can
start at a well-scaled point rather than at a prior draw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
)
"""Module types treated as normalisation layers by ``random="norm_and_head"``."""

RandomSpec = str | Iterable[str] | Callable[[str, nn.Module, str], bool]

_PRIOR_LOC = "_prior_loc_"
_PRIOR_SCALE = "_prior_scale_"
_INIT = "_init_"


class _GaussianPrior:
    """``PyroSample`` prior built from the module's buffers each call, so it follows the module's device.

    A small class instead of a lambda so that the module stays picklable.
    """

    def __init__(self, param_name: str) -> None:
        self.param_name = param_name

    def __call__(self, module: nn.Module) -> dist.Distribution:
        loc = getattr(module, _PRIOR_LOC + self.param_name)
        scale = getattr(module, _PRIOR_SCALE + self.param_name)
        shape = getattr(module, _INIT + self.param_name).shape
        return dist.Normal(loc, scale).expand(shape).to_event(len(shape))


def head_module_name(module: nn.Module) -> str:
    """The qualified name of the network's head: the last ``nn.Linear`` (or conv layer) in module order."""
    head = None
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, nn.modules.conv._ConvNd)):
            head = name
    if head is None:
        raise ValueError("could not find a head: the module has no nn.Linear or convolution layer")
    return head


def _random_predicate(module: nn.Module, random: RandomSpec) -> Callable[[str, nn.Module, str], bool]:
    if callable(random):
        return random
    if isinstance(random, str):
        if random == "all":
            return lambda *_: True
        if random in ("norm_and_head", "head"):
            head = head_module_name(module)
            if random == "head":
                return lambda mname, _sub, _param: mname == head
            return lambda mname, sub, _: isinstance(sub, NORM_LAYERS) or mname == head
        raise ValueError(
            "`random` must be 'all', 'norm_and_head', 'head', a collection of parameter names or a callable, "
            f"got {random!r}"
        )
    names = set(random)
    known = {name for name, _ in module.named_parameters()}
    unknown = names - known
    if unknown:
        raise ValueError(
            f"`random` names parameters the module does not have: {sorted(unknown)}; known: {sorted(known)}"
        )
    return lambda mname, _, pname: (f"{mname}.{pname}" if mname else pname) in names


def make_bayesian(
    module: nn.Module,
    *,
    random: RandomSpec = "all",
    prior_scale: float = 1.0,
    prior_loc: str = "zero",
    rest: str = "frozen",
) -> PyroModule:
    r"""Convert ``module`` **in place** into a :class:`~pyro.nn.PyroModule` whose chosen parameters are latent.

    :param module: any torch network.
    :param random: which parameters become random: ``"all"``; ``"norm_and_head"`` (the affine parameters of
        normalisation layers and the last linear/conv layer, as in Bayesian transfer learning [1]); ``"head"`` (the
        last linear/conv layer only: a last-layer Bayesian network); a collection of qualified parameter names
        (``"0.weight"``); or a predicate ``(module_name, submodule, param_name) -> bool``.
    :param prior_scale: standard deviation :math:`s > 0` of the Gaussian prior.
    :param prior_loc: ``"zero"`` or ``"current"`` (centre the prior at the parameter's present value).
    :param rest: what happens to the other parameters: ``"frozen"`` (become buffers) or ``"learned"`` (stay
        ``nn.Parameter`` s, i.e. ``pyro.param`` sites optimised by SVI).
    :returns: the same object, now a ``PyroModule``.

    References:
        * [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
          Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {type(module).__name__}")
    if not (isinstance(prior_scale, (int, float)) and prior_scale > 0 and prior_scale != float("inf")):
        raise ValueError(f"`prior_scale` must be a finite number > 0, got {prior_scale!r}")
    if prior_loc not in ("zero", "current"):
        raise ValueError(f"`prior_loc` must be 'zero' or 'current', got {prior_loc!r}")
    if rest not in ("frozen", "learned"):
        raise ValueError(f"`rest` must be 'frozen' or 'learned', got {rest!r}")
    is_random = _random_predicate(module, random)
    to_pyro_module_(module)
    num_random = 0
    for mname, sub in list(module.named_modules()):
        for pname, value in list(sub.named_parameters(recurse=False)):
            data = value.detach().clone()
            if is_random(mname, sub, pname):
                loc = data.clone() if prior_loc == "current" else torch.zeros((), dtype=data.dtype, device=data.device)
                delattr(sub, pname)
                sub.register_buffer(_INIT + pname, data)
                sub.register_buffer(_PRIOR_LOC + pname, loc)
                sub.register_buffer(_PRIOR_SCALE + pname, torch.full((), float(prior_scale), dtype=data.dtype))
                setattr(sub, pname, PyroSample(_GaussianPrior(pname)))
                num_random += 1
            elif rest == "frozen":
                delattr(sub, pname)
                sub.register_buffer(pname, data)
    if num_random == 0:
        raise ValueError(
            f"`random={random!r}` selected no parameter of the module: the model would have no latent site"
        )
    return module


def latent_init_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """The network's initial values of its random parameters, keyed by Pyro site name (``"net.0.weight"``)."""
    if not isinstance(module, PyroModule):
        raise TypeError("`module` must be a PyroModule made by make_bayesian")
    values = {}
    for mname, sub in module.named_modules():
        for bname, buf in sub.named_buffers(recurse=False):
            if bname.startswith(_INIT):
                pname = bname[len(_INIT) :]
                path = ".".join(p for p in (module._pyro_name, mname, pname) if p)
                values[path] = buf
    return values


class init_to_network:  # noqa: N801 (named like Pyro's init_to_* strategies)
    """An ``init_loc_fn`` for autoguides that starts every random weight at the network's own initialisation.

    Sites that are not weights of ``module`` fall back to :func:`pyro.infer.autoguide.init_to_median`. The values
    are read from the module's buffers at call time, so they follow ``module.to(device)``. Use as
    ``AutoNormal(model, init_loc_fn=init_to_network(model))``.

    :param module: a ``PyroModule`` made by :func:`make_bayesian` (or containing one).
    """

    def __init__(self, module: nn.Module) -> None:
        if not latent_init_values(module):
            raise ValueError("`module` has no random parameters made by make_bayesian")
        self.module = module

    def __call__(self, site: dict) -> torch.Tensor:
        from pyro.infer.autoguide.initialization import init_to_median

        value = latent_init_values(self.module).get(site["name"])
        if value is None:
            return init_to_median(site)
        return value.detach().clone()

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

**Packed latents** (``packed=True``, or :func:`pack_latents` afterwards): the random parameters become *one* sample
site ``"{name}.weights"`` of shape ``[P]`` (:math:`P` the number of random weights) with the same prior,
:math:`\mathcal N(\mathrm{vec}(m), \mathrm{vec}(s)^2 I_P)`, and before each forward pass its value is viewed into the
parameters (``split`` along the last dimension, then ``unflatten`` to each parameter's shape). The density is the
per-tensor one and, for a guide that draws the same numbers, so are the loss and its gradients; but a prior or guide
density, a guide draw, a SAM step or an optimiser update is then a handful of tensor operations instead of a handful
per parameter tensor — on a GPU, a few kernel launches instead of thousands, and one site for Pyro to trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

from .._internals import BatchNormBase, InstanceNormBase
from .._validation import check_real

NORM_LAYERS: tuple[type[nn.Module], ...] = (
    BatchNormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    InstanceNormBase,
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
    packed: bool = False,
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
    :param packed: make the random parameters one sample site ``"weights"`` (:func:`pack_latents`) instead of one
        site per parameter tensor (default ``False``).
    :returns: the same object, now a ``PyroModule``.

    References:
        * [1] `Flat Posterior Does Matter For Bayesian Model Averaging`, Sungjun Lim, Jeyoon Yeom, Sooyon Kim,
          Hoyoon Byun, Jinho Kang, Yohan Jung, Jiyoung Jung, Kyungwoo Song (2024), arXiv:2406.15664
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {type(module).__name__}")
    check_real(prior_scale, "prior_scale", low=0, low_open=True)
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
                sub.register_buffer(_PRIOR_SCALE + pname, data.new_full((), float(prior_scale)))
                setattr(sub, pname, PyroSample(_GaussianPrior(pname)))
                num_random += 1
            elif rest == "frozen":
                delattr(sub, pname)
                sub.register_buffer(pname, data)
    if num_random == 0:
        raise ValueError(
            f"`random={random!r}` selected no parameter of the module: the model would have no latent site"
        )
    if not isinstance(packed, bool):
        raise ValueError(f"`packed` must be a bool, got {packed!r}")
    return pack_latents(module) if packed else module


class _PackedLatents:
    """Where the value of a packed site goes: ``(submodule, parameter name, shape)`` per parameter, in order."""

    def __init__(self, name: str, targets: list[tuple[nn.Module, str, torch.Size]]) -> None:
        self.name = name
        self.targets = targets
        self.sizes = [shape.numel() for _, _, shape in targets]
        self.size = sum(self.sizes)


def _bind_packed(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: draw the packed site and view its value into the parameters it holds."""
    packed: _PackedLatents = module._packed_latents
    flat = getattr(module, packed.name)  # the sample site (PyroSample), cached for this call of the module
    if flat.dim() == 0 or flat.shape[-1] != packed.size:
        raise ValueError(f"the packed site {packed.name!r} needs values of shape [..., {packed.size}] (one entry per "
                         f"latent weight), got shape {tuple(flat.shape)}")
    for (sub, pname, shape), chunk in zip(packed.targets, flat.split(packed.sizes, dim=-1), strict=True):
        sub.__dict__[pname] = chunk.unflatten(-1, shape)


def _unbind_packed(module: nn.Module, args: tuple, output: object) -> None:
    """Forward hook (also after an exception): drop the views, so that no sampled value outlives the call."""
    for sub, pname, _ in module._packed_latents.targets:
        sub.__dict__.pop(pname, None)


def pack_latents(module: PyroModule, name: str = "weights") -> PyroModule:
    r"""Turn the per-tensor latent parameters of a network made by :func:`make_bayesian` **in place** into one sample
    site ``name`` of shape ``[P]``, whose value is viewed into the parameters before each forward pass (see the
    module docstring).

    The prior is unchanged: :math:`\mathcal N(\mathrm{vec}(m), \mathrm{vec}(s)^2 I_P)` built from the per-parameter
    prior locations and scales (one location and one scale buffer if they are all the same number), and the network's
    initial values become one buffer (:func:`init_to_network` returns it for the packed site). The order of the
    parameters in the packed vector is the module order of ``named_modules``. Pack after the network's structure is
    final (a module replaced afterwards is not re-bound).

    :param module: a ``PyroModule`` made by :func:`make_bayesian` (per-tensor latents).
    :param name: the attribute of ``module`` that becomes the packed site (default ``"weights"``; the site is
        ``"{module's Pyro name}.weights"``, e.g. ``"net.weights"`` in a :class:`~pyro_flat.nn.BayesianClassifier`).
    :returns: the same object.
    :raises ValueError: if ``module`` has no latent parameter made by :func:`make_bayesian`, is already packed, or
        already has an attribute ``name``.
    """
    if not isinstance(module, PyroModule):
        raise TypeError(f"`module` must be a PyroModule made by make_bayesian, got {type(module).__name__}")
    if hasattr(module, "_packed_latents"):
        raise ValueError("`module` is already packed")
    if not isinstance(name, str) or not name.isidentifier() or hasattr(module, name):
        raise ValueError(f"`name` must be an identifier that is not an attribute of the module, got {name!r}")
    targets, inits, locs, scales = [], [], [], []
    for _, sub in module.named_modules():
        for bname, init in list(sub.named_buffers(recurse=False)):
            if not bname.startswith(_INIT):
                continue
            pname = bname[len(_INIT) :]
            loc, scale = getattr(sub, _PRIOR_LOC + pname), getattr(sub, _PRIOR_SCALE + pname)
            targets.append((sub, pname, init.shape))
            inits.append(init.reshape(-1))
            locs.append(loc.expand(init.shape).reshape(-1) if loc.dim() else loc)
            scales.append(scale.expand(init.shape).reshape(-1) if scale.dim() else scale)
            for buffer in (_INIT, _PRIOR_LOC, _PRIOR_SCALE):
                delattr(sub, buffer + pname)
            delattr(sub, pname)  # the PyroSample
    if not targets:
        raise ValueError("`module` has no latent parameter made by make_bayesian to pack")
    init = torch.cat(inits)
    module.register_buffer(_INIT + name, init)
    for prefix, parts in ((_PRIOR_LOC, locs), (_PRIOR_SCALE, scales)):
        scalars = [p for p in parts if p.dim() == 0]
        # one host read, at construction; values on the meta device are unknown, so kept one per weight
        if len(scalars) == len(parts) and not init.is_meta and bool(torch.stack(scalars).eq(parts[0]).all()):
            module.register_buffer(prefix + name, parts[0].clone())
        else:
            module.register_buffer(prefix + name, torch.cat([p.expand(n) if p.dim() == 0 else p for p, n in zip(
                parts, [i.numel() for i in inits], strict=True)]).to(init))
    setattr(module, name, PyroSample(_GaussianPrior(name)))
    module._packed_latents = _PackedLatents(name, targets)
    module.register_forward_pre_hook(_bind_packed)
    module.register_forward_hook(_unbind_packed, always_call=True)
    return module


def unpacked_sites(module: nn.Module) -> dict[str, dict[str, torch.Size]]:
    """For each packed site of ``module`` (:func:`pack_latents`), the per-tensor sites it holds, in its order:
    ``{packed site: {per-tensor site name: shape}}`` (the names ``make_bayesian`` gives without packing, e.g.
    ``"net.0.weight"``). A value of the packed site is the concatenation of the flattened per-tensor values, so this
    relabels anything indexed by it (a SWAG collector's moments, a guide's location) per tensor."""
    out = {}
    for sub in module.modules():
        packed = getattr(sub, "_packed_latents", None)
        if packed is None:
            continue
        paths = {id(m): name for name, m in sub.named_modules()}
        prefix = getattr(sub, "_pyro_name", "")
        out[".".join(p for p in (prefix, packed.name) if p)] = {
            ".".join(p for p in (prefix, paths[id(target)], pname) if p): shape
            for target, pname, shape in packed.targets
        }
    return out


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) holds its latent weights as one packed site (:func:`pack_latents`)."""
    return any(hasattr(sub, "_packed_latents") for sub in module.modules())


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

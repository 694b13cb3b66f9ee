r"""Turning a torch network into a (partly) Bayesian :class:`~pyro.nn.PyroModule`.

:func:`make_bayesian` converts an ``nn.Module`` in place with :func:`pyro.nn.module.to_pyro_module_` and replaces a
chosen subset of its parameters :math:`\theta_j` by :class:`~pyro.nn.PyroSample` latent sites with the Gaussian prior

.. math:: p(\theta_j) = \mathcal N(\theta_j;\ m_j,\ s^2 I),

where :math:`s` is ``prior_scale`` and :math:`m_j` is zero (``prior_loc="zero"``) or the parameter's current value
(``prior_loc="current"``, the natural prior for transfer learning from a pretrained network). The parameters that
are not random are either frozen (turned into buffers, so no Pyro optimiser touches them) or left as learnable
``pyro.param`` sites.

**Tied weights.** A parameter tensor held by several modules (weight tying, ``decoder.weight = encoder.weight``, a
module used twice) is *one* latent site with one prior, held by its first holder in module order and named as Pyro
names that module (a module used twice has the later of its names: ``Sequential(lin, act, lin)`` gives ``"2.weight"``);
at each call of the network its value is put into every other holder (a forward pre-hook of the module given to
:func:`make_bayesian`). It is random if any of its names is selected by ``random``.

**Layers.** Any layer whose forward reads its parameters as attributes works (linear, convolutions, embeddings,
normalisation, attention's ``in_proj_weight``, ...); recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) hand
their weights to the kernel through a cache, which :mod:`pyro_flat.nn.recurrent` replaces. Call the network as a
whole: a latent weight that is packed or tied has a value only during a call of the module given to
:func:`make_bayesian`.

Prior locations and scales live in buffers, so ``model.to(device)`` moves the prior with the network. The network's
own initialisation is kept (a buffer per random parameter) and exposed through :func:`init_to_network`, so guides can
start at a well-scaled point rather than at a prior draw.

**Packed latents** (the default; ``packed=False`` keeps one site per parameter tensor, which :func:`pack_latents`
packs afterwards): the random parameters become *one* sample site ``"{name}.weights"`` of shape ``[P]`` (:math:`P`
the number of random weights) with the same prior, :math:`\mathcal N(\mathrm{vec}(m), \mathrm{vec}(s)^2 I_P)`, and
before each forward pass its value is viewed into the parameters (``split`` along the last dimension, then
``unflatten`` to each parameter's shape). The density is the per-tensor one and, for a guide that draws the same
numbers, so are the loss and its gradients; but a prior or guide density, a guide draw, a SAM step or an optimiser
update is then a handful of tensor operations instead of a handful per parameter tensor — on a GPU, a few kernel
launches instead of thousands, and one site for Pyro to trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import Tensor, nn

from .._internals import BatchNormBase, InstanceNormBase
from .._validation import check_real
from .recurrent import latent_recurrent_

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
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    unknown = names - known
    if unknown:
        raise ValueError(
            f"`random` names parameters the module does not have: {sorted(unknown)}; known: {sorted(known)}"
        )
    return lambda mname, _, pname: _join(mname, pname) in names


def _join(*names: str) -> str:
    return ".".join(name for name in names if name)


def _site_name(module: nn.Module, attribute: str) -> str:
    """The Pyro site name of ``module``'s latent attribute: the module's Pyro name (its path from the root
    ``PyroModule``) and the attribute."""
    return _join(getattr(module, "_pyro_name", ""), attribute)


def _parameter_holders(module: nn.Module) -> list[tuple[Tensor, list[tuple[str, nn.Module, str]]]]:
    """Each parameter tensor of ``module`` once (in module order), with every ``(module name, submodule, attribute)``
    that holds it: more than one for tied weights and for a submodule used at several places."""
    holders: dict[int, tuple[Tensor, list[tuple[str, nn.Module, str]]]] = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for pname, value in sub.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(value), (value, []))[1].append((mname, sub, pname))
    return list(holders.values())


def _latent_inits(module: nn.Module) -> dict[str, Tensor]:
    """The initial-value buffers :func:`make_bayesian` made in ``module`` and its submodules, by site name."""
    return {_site_name(sub, bname[len(_INIT):]): buf for sub in module.modules()
            for bname, buf in sub.named_buffers(recurse=False) if bname.startswith(_INIT)}


def make_bayesian(
    module: nn.Module,
    *,
    random: RandomSpec = "all",
    prior_scale: float = 1.0,
    prior_loc: str = "zero",
    rest: str = "frozen",
    packed: bool = True,
) -> PyroModule:
    r"""Convert ``module`` **in place** into a :class:`~pyro.nn.PyroModule` whose chosen parameters are latent.

    :param module: any torch network (see the module docstring for tied weights and recurrent layers).
    :param random: which parameters become random: ``"all"``; ``"norm_and_head"`` (the affine parameters of
        normalisation layers and the last linear/conv layer, as in Bayesian transfer learning [1]); ``"head"`` (the
        last linear/conv layer only: a last-layer Bayesian network); a collection of qualified parameter names
        (``"0.weight"``); or a predicate ``(module_name, submodule, param_name) -> bool``. A tensor held under
        several names (tied) is random if any of them is selected.
    :param prior_scale: standard deviation :math:`s > 0` of the Gaussian prior.
    :param prior_loc: ``"zero"`` or ``"current"`` (centre the prior at the parameter's present value).
    :param rest: what happens to the other parameters: ``"frozen"`` (become buffers; a tied tensor stays one buffer)
        or ``"learned"`` (stay ``nn.Parameter`` s, i.e. ``pyro.param`` sites optimised by SVI).
    :param packed: make the random parameters one sample site ``"weights"`` (:func:`pack_latents`, default ``True``:
        a step then launches a few kernels for the site instead of a few per weight tensor, 4x faster on a GPU's
        ResNet-18) or, with ``False``, one site per parameter tensor (``"0.weight"``, ..., to condition, block or guide
        tensors one by one).
    :returns: the same object, now a ``PyroModule``.
    :raises ValueError: for a bad option, a selection of no parameter, or a network that is already Bayesian.

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
    if not isinstance(packed, bool):
        raise ValueError(f"`packed` must be a bool, got {packed!r}")
    if made := list(_latent_inits(module)):
        raise ValueError(f"`module` is already Bayesian: make_bayesian has made its latent sites {made[:3]}"
                         f"{' ...' if len(made) > 3 else ''}; convert a plain torch network, once")
    is_random = _random_predicate(module, random)
    tensors = [(value, holders, any(is_random(*holder) for holder in holders))
               for value, holders in _parameter_holders(module)]
    if not any(chosen for _, _, chosen in tensors):
        raise ValueError(
            f"`random={random!r}` selected no parameter of the module: the model would have no latent site"
        )
    for mname, sub, pname in (holder for _, holders, chosen in tensors if chosen for holder in holders):
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None:
            raise ValueError(
                f"`random` selects {_join(mname, pname)!r} of an {type(sub).__name__} with max_norm={sub.max_norm}, "
                "which renormalises that weight in place at every call: a latent weight (the value the guide drew "
                "and the prior scored) must not change; build the layer with max_norm=None, or leave it out of "
                "`random`"
            )
    to_pyro_module_(module)
    for _, holders, chosen in tensors:
        for _, sub, _ in holders:
            if chosen and isinstance(sub, nn.RNNBase):
                latent_recurrent_(sub)
    tied = []
    for value, holders, chosen in tensors:
        if not chosen and rest == "learned":
            continue
        places = list(dict.fromkeys((sub, pname) for _, sub, pname in holders))  # each (module, attribute) once
        data = value.detach().clone()
        for sub, pname in places:
            delattr(sub, pname)
        if not chosen:
            for sub, pname in places:
                sub.register_buffer(pname, data)  # one buffer for a tied tensor
            continue
        (owner, name), *others = places
        loc = data.clone() if prior_loc == "current" else torch.zeros((), dtype=data.dtype, device=data.device)
        owner.register_buffer(_INIT + name, data)
        owner.register_buffer(_PRIOR_LOC + name, loc)
        owner.register_buffer(_PRIOR_SCALE + name, data.new_full((), float(prior_scale)))
        setattr(owner, name, PyroSample(_GaussianPrior(name)))
        tied += [_Tie(sub, pname, owner, name) for sub, pname in others]
    if tied:
        _latent_views(module).tied += tied
        _show_latents(module)
    return pack_latents(module) if packed else module


class _Tie(NamedTuple):
    """``module.attribute`` holds the latent weight ``owner.owner_attribute`` (tied weights)."""

    module: nn.Module
    attribute: str
    owner: nn.Module
    owner_attribute: str


class _PackedLatents:
    """Where the value of a packed site goes: ``(places, shape)`` per parameter tensor, in order; ``places`` are the
    ``(submodule, attribute)`` holding it (more than one for tied weights)."""

    def __init__(self, name: str, targets: list[tuple[list[tuple[nn.Module, str]], torch.Size]]) -> None:
        self.name = name
        self.targets = targets
        self.sizes = [shape.numel() for _, shape in targets]
        self.size = sum(self.sizes)


class _LatentViews:
    """What the forward pre-hook of a network made by :func:`make_bayesian` puts into its modules for one call (and
    its forward hook takes out): the views of the packed site (``packed``) and the values of the tied weights
    (``tied``)."""

    def __init__(self) -> None:
        self.packed: _PackedLatents | None = None
        self.tied: list[_Tie] = []

    def places(self) -> list[tuple[nn.Module, str]]:
        packed = [] if self.packed is None else [place for places, _ in self.packed.targets for place in places]
        return packed + [(tie.module, tie.attribute) for tie in self.tied]


class _LatentRepr:
    """A holder's ``extra_repr``: between calls its packed or tied weights have no value (they are views of one call's
    sample), so torch's ``extra_repr`` (``bias=self.bias is not None``, ...) reads shape-only stand-ins on the
    ``meta`` device, dropped after."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.shapes: dict[str, torch.Size] = {}

    def __call__(self) -> str:
        module = self.module
        absent = {name: torch.empty(shape, device="meta") for name, shape in self.shapes.items()
                  if name not in module.__dict__}
        module.__dict__.update(absent)
        try:
            return type(module).extra_repr(module)
        finally:
            for name in absent:
                module.__dict__.pop(name, None)


def _show_latents(module: nn.Module) -> None:
    """Give every holder of a packed or tied weight of ``module`` a :class:`_LatentRepr` (so that it prints)."""
    views: _LatentViews = module._latent_views
    shapes = [(places, shape) for places, shape in views.packed.targets] if views.packed is not None else []
    shapes += [([(tie.module, tie.attribute)], getattr(tie.owner, _INIT + tie.owner_attribute).shape)
               for tie in views.tied if hasattr(tie.owner, _INIT + tie.owner_attribute)]
    for places, shape in shapes:
        for sub, pname in places:
            show = sub.__dict__.get("extra_repr")
            if not isinstance(show, _LatentRepr):
                show = sub.__dict__["extra_repr"] = _LatentRepr(sub)
            show.shapes[pname] = shape


def _latent_views(module: nn.Module) -> _LatentViews:
    """``module``'s :class:`_LatentViews`, made (with its two hooks) at the first call."""
    views = getattr(module, "_latent_views", None)
    if views is None:
        views = module._latent_views = _LatentViews()
        module.register_forward_pre_hook(_bind_views)
        module.register_forward_hook(_unbind_views, always_call=True)
    return views


def _bind_views(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: view the packed site into the parameters it holds, and each tied weight into its other
    holders."""
    views: _LatentViews = module._latent_views
    if views.packed is not None:
        packed = views.packed
        flat = getattr(module, packed.name)  # the sample site (PyroSample), cached for this call of the module
        if flat.dim() == 0 or flat.shape[-1] != packed.size:
            raise ValueError(f"the packed site {packed.name!r} needs values of shape [..., {packed.size}] (one entry "
                             f"per latent weight), got shape {tuple(flat.shape)}")
        for (places, shape), chunk in zip(packed.targets, flat.split(packed.sizes, dim=-1), strict=True):
            value = chunk.unflatten(-1, shape)
            for sub, pname in places:
                sub.__dict__[pname] = value
    for tie in views.tied:
        tie.module.__dict__[tie.attribute] = getattr(tie.owner, tie.owner_attribute)


def _unbind_views(module: nn.Module, args: tuple, output: object) -> None:
    """Forward hook (also after an exception): drop the views, so that no sampled value outlives the call."""
    for sub, pname in module._latent_views.places():
        sub.__dict__.pop(pname, None)


def pack_latents(module: PyroModule, name: str = "weights") -> PyroModule:
    r"""Turn the per-tensor latent parameters of a network made by :func:`make_bayesian` **in place** into one sample
    site ``name`` of shape ``[P]``, whose value is viewed into the parameters before each forward pass (see the
    module docstring).

    The prior is unchanged: :math:`\mathcal N(\mathrm{vec}(m), \mathrm{vec}(s)^2 I_P)` built from the per-parameter
    prior locations and scales (one location and one scale buffer if they are all the same number), and the network's
    initial values become one buffer (:func:`init_to_network` returns it for the packed site). The order of the
    parameters in the packed vector is the module order of ``named_modules``; a tied tensor is in it once. Pack after
    the network's structure is final (a module replaced afterwards is not re-bound).

    :param module: a ``PyroModule`` made by :func:`make_bayesian` with ``packed=False`` (per-tensor latents).
    :param name: the attribute of ``module`` that becomes the packed site (default ``"weights"``; the site is
        ``"{module's Pyro name}.weights"``, e.g. ``"net.weights"`` in a :class:`~pyro_flat.nn.BayesianClassifier`).
    :returns: the same object.
    :raises ValueError: if ``module`` has no latent parameter made by :func:`make_bayesian`, is already packed, or
        already has an attribute ``name``.
    """
    if not isinstance(module, PyroModule):
        raise TypeError(f"`module` must be a PyroModule made by make_bayesian, got {type(module).__name__}")
    if is_packed(module):
        raise ValueError("`module` is already packed")
    if not isinstance(name, str) or not name.isidentifier() or hasattr(module, name):
        raise ValueError(f"`name` must be an identifier that is not an attribute of the module, got {name!r}")
    owners = [(sub, bname[len(_INIT):]) for _, sub in module.named_modules()
              for bname, _ in sub.named_buffers(recurse=False) if bname.startswith(_INIT)]
    if not owners:
        raise ValueError("`module` has no latent parameter made by make_bayesian to pack")
    tied: dict[tuple[nn.Module, str], list[tuple[nn.Module, str]]] = {owner: [] for owner in owners}
    for sub in module.modules():
        views = getattr(sub, "_latent_views", None)
        if views is not None:  # the ties of packed weights move into the packed site's places
            for tie in views.tied:
                tied.get((tie.owner, tie.owner_attribute), []).append((tie.module, tie.attribute))
            views.tied = [tie for tie in views.tied if (tie.owner, tie.owner_attribute) not in tied]
    targets, inits, locs, scales = [], [], [], []
    for sub, pname in owners:
        init = getattr(sub, _INIT + pname)
        loc, scale = getattr(sub, _PRIOR_LOC + pname), getattr(sub, _PRIOR_SCALE + pname)
        targets.append(([(sub, pname), *tied[sub, pname]], init.shape))
        inits.append(init.reshape(-1))
        locs.append(loc.expand(init.shape).reshape(-1) if loc.dim() else loc)
        scales.append(scale.expand(init.shape).reshape(-1) if scale.dim() else scale)
        for buffer in (_INIT, _PRIOR_LOC, _PRIOR_SCALE):
            delattr(sub, buffer + pname)
        delattr(sub, pname)  # the PyroSample
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
    _latent_views(module).packed = _PackedLatents(name, targets)
    _show_latents(module)
    return module


def _packed_sites(module: nn.Module) -> Iterator[tuple[nn.Module, _PackedLatents]]:
    """``(submodule, its packed site)`` for every packed site of ``module``."""
    for sub in module.modules():
        views = getattr(sub, "_latent_views", None)
        if views is not None and views.packed is not None:
            yield sub, views.packed


def unpacked_sites(module: nn.Module) -> dict[str, dict[str, torch.Size]]:
    """For each packed site of ``module`` (:func:`pack_latents`), the per-tensor sites it holds, in its order:
    ``{packed site: {per-tensor site name: shape}}`` (the names ``make_bayesian`` gives without packing, e.g.
    ``"net.0.weight"``). A value of the packed site is the concatenation of the flattened per-tensor values, so this
    relabels anything indexed by it (a SWAG collector's moments, a guide's location) per tensor."""
    return {_site_name(sub, packed.name): {_site_name(*places[0]): shape for places, shape in packed.targets}
            for sub, packed in _packed_sites(module)}


def is_packed(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) holds its latent weights as one packed site (:func:`pack_latents`)."""
    return any(True for _ in _packed_sites(module))


def latent_init_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """The network's initial values of its random parameters, keyed by Pyro site name (``"net.weights"`` packed,
    ``"net.0.weight"``, ... per tensor)."""
    if not isinstance(module, PyroModule):
        raise TypeError("`module` must be a PyroModule made by make_bayesian")
    return _latent_inits(module)


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

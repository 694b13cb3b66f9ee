"""Recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) whose weights are latent.

torch's recurrent layers hand their weights to the kernel as one list, ``RNNBase._flat_weights``, a cache that torch
keeps in step with the weight attributes (and that cuDNN's ``flatten_parameters`` lays out in one buffer). A latent
weight is a new tensor at every call of the network (a :class:`~pyro.nn.PyroSample` draw, or a view of the packed
site), and between calls it is absent. :func:`latent_recurrent_` gives such a layer, in place, a class whose
``_flat_weights`` is read afresh from the weight attributes at every access (as Pyro's ``PyroModule[nn.RNNBase]``
does) but is ``None`` for a weight that has no value outside a call, and whose ``flatten_parameters`` does nothing:
there is no lasting weight to lay out, and cuDNN copies the weights of each call into its layout itself.
"""

from __future__ import annotations

from typing import Any

from pyro.nn import PyroModule
from torch import nn

from .._internals import RNN_FLAT_WEIGHTS, rnn_weight_names

__all__ = ["latent_recurrent_"]


class _LatentFlatWeights:
    """The ``_flat_weights`` of a recurrent layer with latent weights: the weights' current values, read at each
    access (``None`` for one that has none now); assignments (torch's cache updates) are ignored."""

    def __get__(self, layer: nn.RNNBase | None, owner: type | None = None) -> object:
        if layer is None:
            return self
        return [getattr(layer, name, None) for name in rnn_weight_names(layer)]

    def __set__(self, layer: nn.RNNBase, value: object) -> None:
        pass


class _LatentRecurrent:
    """The mixin of :func:`latent_recurrent_`'s classes."""

    _torch_class: type[nn.RNNBase]

    def flatten_parameters(self) -> None:
        """Nothing to do: the latent weights are new tensors at every call (cuDNN copies them into its layout)."""

    def __reduce__(self) -> tuple:
        return _new_latent_recurrent, (self._torch_class,), self.__getstate__()


_CLASSES: dict[type, type] = {}


def _latent_class(torch_class: type[nn.RNNBase]) -> type:
    """``PyroModule[torch_class]`` with :class:`_LatentRecurrent` mixed in, made once per class."""
    if torch_class not in _CLASSES:
        pyro_class = PyroModule[torch_class]
        _CLASSES[torch_class] = type(pyro_class)(pyro_class.__name__, (_LatentRecurrent, pyro_class), {
            RNN_FLAT_WEIGHTS: _LatentFlatWeights(), "_torch_class": torch_class, "__module__": __name__})
    return _CLASSES[torch_class]


def _new_latent_recurrent(torch_class: type[nn.RNNBase]) -> Any:
    """An empty layer of :func:`_latent_class` ``(torch_class)``, whose state unpickling then sets."""
    cls = _latent_class(torch_class)
    return cls.__new__(cls)


def latent_recurrent_(layer: nn.RNNBase) -> nn.RNNBase:
    """Let the recurrent ``layer`` (a ``PyroModule``, e.g. converted by :func:`pyro.nn.module.to_pyro_module_`) hold
    latent weights: change its class **in place** (see the module docstring). Returns ``layer``."""
    if not isinstance(layer, nn.RNNBase) or not isinstance(layer, PyroModule):
        raise TypeError(f"`layer` must be a recurrent PyroModule (nn.RNN, nn.LSTM, nn.GRU), got {type(layer).__name__}")
    if not isinstance(layer, _LatentRecurrent):
        torch_class = next(c for c in type(layer).__mro__ if not issubclass(c, PyroModule))
        layer.__class__ = _latent_class(torch_class)
        layer.__dict__.pop(RNN_FLAT_WEIGHTS, None)  # torch's cache: it holds the weights the layer had
    return layer

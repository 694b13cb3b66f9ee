"""Recurrent layers with latent weights between calls: moved, cast, copied, pickled and flattened without drawing or
keeping a weight, and the same network after it. (Their log joint against a hand-written one:
tests/conformance/test_networks.py.)"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from pyro import poutine
from pyro.nn import PyroModule
from torch import nn

from pyro_flat.nn import latent_init_values, make_bayesian
from pyro_flat.nn.recurrent import latent_recurrent_


@pytest.mark.parametrize("packed", [False, True], ids=["per tensor", "packed"])
@pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU, nn.RNN])
def test_between_calls_the_layer_moves_copies_pickles_and_holds_no_weight(layer, packed):
    torch.manual_seed(0)
    rnn = make_bayesian(layer(3, 4, num_layers=2), packed=packed)
    assert "_flat_weights" not in rnn.__dict__  # torch's cache of the weights the layer had is gone
    x = torch.randn(5, 2, 3)
    values = latent_init_values(rnn)

    def output(module):
        with poutine.condition(data=values):
            return module(x)[0]

    expected = output(rnn)
    rnn.float()
    rnn.double()
    rnn.flatten_parameters()
    assert not {"weight_ih_l0", "_flat_weights"} & set(rnn.__dict__)  # no value of the last call kept
    for other in (copy.deepcopy(rnn), pickle.loads(pickle.dumps(rnn)), rnn):
        assert type(other) is type(rnn) and isinstance(other, PyroModule[layer])
        torch.testing.assert_close(output(other), expected, rtol=0, atol=0)


def test_latent_recurrent_is_for_recurrent_pyro_modules():
    with pytest.raises(TypeError, match="recurrent PyroModule"):
        latent_recurrent_(nn.LSTM(2, 2))
    with pytest.raises(TypeError, match="recurrent PyroModule"):
        latent_recurrent_(PyroModule[nn.Linear](2, 2))

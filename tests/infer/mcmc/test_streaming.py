"""DrawBuffer: every draw kept in rows allocated once (in memory or in mapped files), through Pyro's MCMC hooks."""

from __future__ import annotations

import json

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.mcmc.api import StreamingMCMC
from pyro.ops.streaming import CountStats, StatsOfDict

from pyro_flat.infer.mcmc import SGLD, DrawBuffer, EntropyMCMC


def model():
    pyro.sample("w", dist.Normal(torch.zeros(2, 3), 1.0).to_event(2))
    pyro.sample("scale", dist.LogNormal(0.0, 0.5))  # constrained: kept in constrained space


def _mcmc_samples(num_samples=6, warmup_steps=3, seed=4):
    pyro.set_rng_seed(seed)
    mcmc = MCMC(SGLD(model, step_size=0.01), num_samples=num_samples, warmup_steps=warmup_steps,
                disable_progbar=True)
    mcmc.run()
    return mcmc.get_samples()


def _buffered(buffer, num_samples=6, warmup_steps=3, seed=4):
    pyro.set_rng_seed(seed)
    StreamingMCMC(SGLD(model, step_size=0.01), num_samples=num_samples, warmup_steps=warmup_steps, hook_fn=buffer,
                  statistics=StatsOfDict(default=CountStats), disable_progbar=True).run()
    return buffer


@pytest.mark.parametrize("on_disk", [False, True])
def test_streaming_mcmc_with_a_buffer_keeps_mcmcs_draws(on_disk, tmp_path):
    expected = _mcmc_samples()
    buffer = _buffered(DrawBuffer(6, directory=tmp_path / "draws" if on_disk else None))
    samples = buffer.samples()
    assert buffer.count == 6 and set(samples) == set(expected)
    for name, value in expected.items():
        assert torch.equal(samples[name], value), name  # warm-up skipped, constrained, bit for bit
    assert (samples["scale"] > 0).all()
    if on_disk:
        buffer.flush()
        reopened = DrawBuffer.open(tmp_path / "draws").samples()
        for name, value in expected.items():
            assert torch.equal(reopened[name], value), name


@pytest.mark.parametrize("make_kernel, save_params", [
    (lambda: SGLD(model, step_size=0.01), None),
    (lambda: SGLD(model, step_size=0.01), ["scale"]),
    (lambda: EntropyMCMC(model, eta=0.5, step_size=0.01), None),  # its default keeps theta, not the anchors
])
def test_streaming_mcmc_helper_keeps_what_mcmc_keeps_and_lets_pyro_copy_nothing(make_kernel, save_params):
    pyro.set_rng_seed(2)
    mcmc = MCMC(make_kernel(), num_samples=4, warmup_steps=2, save_params=save_params, disable_progbar=True)
    mcmc.run()
    expected = mcmc.get_samples()
    pyro.set_rng_seed(2)
    kernel = make_kernel()
    if save_params is not None:
        kernel.save_params = save_params
    buffer = DrawBuffer(4)
    buffer.streaming_mcmc(kernel, num_samples=4, warmup_steps=2, disable_progbar=True).run()
    samples = buffer.samples()
    assert set(samples) == set(expected) and kernel.save_params == []  # Pyro's driver kept nothing
    for name, value in expected.items():
        assert torch.equal(samples[name], value), name
    with pytest.raises(ValueError, match="sets hook_fn"):
        buffer.streaming_mcmc(kernel, num_samples=4, hook_fn=print)


def test_rows_are_written_in_place_and_the_count_is_what_is_read():
    buffer = DrawBuffer(3)
    buffer.add({"a": torch.zeros(2), "b": torch.ones(())})
    rows = buffer.buffers["a"]
    buffer.add({"a": torch.full((2,), 2.0), "b": torch.zeros(())})
    assert buffer.buffers["a"] is rows and buffer.buffers["a"].data_ptr() == rows.data_ptr()  # allocated once
    assert torch.equal(buffer.samples()["a"], torch.tensor([[0.0, 0.0], [2.0, 2.0]]))
    buffer.add({"a": torch.ones(2), "b": torch.ones(())})
    with pytest.raises(ValueError, match="all 3 rows are full"):
        buffer.add({"a": torch.ones(2), "b": torch.ones(())})


def test_in_memory_checkpoint_round_trip():
    buffer = DrawBuffer(4, sites=["a"])
    for k in range(3):
        buffer.add({"a": torch.full((2,), float(k)), "ignored": torch.zeros(5)})
    assert set(buffer.samples()) == {"a"}
    state = buffer.state_dict()
    assert state["count"] == 3 and state["draws"]["a"].shape == (3, 2)
    restored = DrawBuffer(4)
    restored.load_state_dict(state)
    restored.add({"a": torch.full((2,), 3.0)})
    assert torch.equal(restored.samples()["a"][:, 0], torch.arange(4.0))


def test_on_disk_checkpoint_holds_only_the_count_and_a_resume_overwrites_later_rows(tmp_path):
    buffer = DrawBuffer(4, directory=tmp_path)
    for k in range(2):
        buffer.add({"a": torch.full((2,), float(k))})
    state = buffer.state_dict()
    assert state == {"count": 2}
    buffer.add({"a": torch.full((2,), 99.0)})  # written after the checkpoint, then the process dies
    assert json.loads((tmp_path / "draws.json").read_text())["count"] == 2  # the count flushed with the checkpoint
    resumed = DrawBuffer(4, directory=tmp_path)
    resumed.load_state_dict(state)
    resumed.add({"a": torch.full((2,), 2.0)})
    resumed.flush()
    assert torch.equal(DrawBuffer.open(tmp_path).samples()["a"][:, 0], torch.arange(3.0))


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="num_draws"):
        DrawBuffer(0)
    with pytest.raises(ValueError, match="mapped on the CPU"):
        DrawBuffer(2, directory=tmp_path, device="meta")
    buffer = DrawBuffer(2, sites=["a"])
    with pytest.raises(ValueError, match=r"sites \['a'\] are not in the draw"):
        buffer.add({"b": torch.zeros(1)})
    buffer.add({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="site 'a' has shape"):
        buffer.add({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="no draws.json"):
        DrawBuffer.open(tmp_path)
    with pytest.raises(ValueError, match="not among the kernel's parameters"):
        _buffered(DrawBuffer(6, sites=["v"]))

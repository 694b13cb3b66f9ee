r"""One mechanism for evaluating a model (and its guide) a second time, exactly as it ran, at other values.

Every flat objective scores one minibatch twice: at the sampled values and at a perturbed copy of them
(:func:`~pyro_flat.transforms.sharpness_aware`: the latent values moved to SAM's ascent point;
:class:`~pyro_flat.infer.KLBallELBO`: the guide's parameters moved to the edge of a KL ball). The second pass must
see the same randomness and the same data as the first, so :class:`RunRecorder` records a run and
:meth:`RunRecorder.replay` runs code again under these rules:

* **the same random numbers**: torch's generators (CPU and the initialised CUDA devices) are set to their state at
  the start of the recorded run, and before and after every recorded sample site to the states recorded there — so
  the guide redraws the same base noise (even when the recorded run drew other numbers before it, e.g. a fresh
  autoguide setting itself up), dropout layers the same masks, and a site whose value the replay gives instead of
  drawing does not shift the stream. After the replay the stream continues exactly as after the recorded run;
* **the same minibatch and observations**: the indices of every subsampled ``pyro.plate`` (of the model and of the
  guide) are replayed, and so are the values of the sites that handlers *outside* the recorder observed (e.g. an
  outer ``pyro.condition``, which the blocked replay does not reach). A site observed inside the replayed code — by
  the model, a ``pyro.condition`` inside it, a ``pyro.deterministic`` record, a ``poutine.reparam`` site — is
  observed again there, at the value that code gives it in the replay;
* **no side effect on BatchNorm**: a BatchNorm layer run during the replay normalises with the batch statistics in
  training mode (and the running ones in eval mode), as always, but updates neither its running statistics nor
  ``num_batches_tracked``;
* **hidden from the enclosing handlers** (optional, default): an outer trace or ``SVI``'s parameter capture does not
  see the replayed sites.

Sites are matched by name and by occurrence (a guide and its model both have a site ``"w"``). Latent values to use in
the replay are given by name; :func:`substituted_tensors` additionally replaces given tensors (e.g. a guide's
parameters) by other tensors wherever an operation reads them, whatever the guide's way of reading them (``pyro.param``,
a ``PyroModule`` attribute, a network registered with ``pyro.module``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .batchnorm import batchnorm_statistics_frozen
from .rng import TorchRandomState, cuda_devices, set_torch_random_state, torch_random_state

__all__ = ["RecordedSite", "RunRecorder", "batchnorm_statistics_frozen", "substituted_tensors"]

@dataclass
class RecordedSite:
    """One sample site of a recorded run.

    :param value: its value at the end of the site.
    :param bool is_observed: whether it was observed.
    :param bool is_subsample: whether it holds the indices of a subsampled ``pyro.plate``.
    :param state_before: the generators' state when the site reached the recorder.
    :param state_after: the generators' state right after the site.
    """

    value: Tensor
    is_observed: bool
    is_subsample: bool
    state_before: TorchRandomState
    state_after: TorchRandomState


class RunRecorder(Messenger):
    """Records the sample sites of a run (the code run inside it) and the random state around them, so that
    :meth:`replay` can run the code again exactly as it ran (see the module docstring).

    Enter it around the first pass; it sees every sample site that reaches it (sites hidden by handlers inside it are
    neither recorded nor needed: the replay redraws them from the same random state)::

        with RunRecorder() as run:
            trace = poutine.trace(model).get_trace(x, y)
        with run.replay(values={"w": w_perturbed}):
            perturbed = poutine.trace(model).get_trace(x, y)
    """

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[int] = []
        self.sites: dict[tuple[str, int], RecordedSite] = {}
        self.start_state: TorchRandomState | None = None
        self._counts: Counter[str] = Counter()
        self._keys: dict[int, tuple[tuple[str, int], TorchRandomState]] = {}

    def __enter__(self) -> RunRecorder:
        self.devices = cuda_devices()
        self.sites, self._counts, self._keys = {}, Counter(), {}
        self.start_state = torch_random_state(self.devices)
        return super().__enter__()

    def _site_key(self, msg: dict) -> tuple[tuple[str, int], TorchRandomState]:
        """The key ``(name, occurrence)`` of a sample message and the random state, fixed when the message first
        reaches this handler (an outer handler may rename it, as ``poutine.do`` does)."""
        entry = self._keys.get(id(msg))
        if entry is None:
            entry = ((msg["name"], self._counts[msg["name"]]), torch_random_state(self.devices))
            self._counts[msg["name"]] += 1
            self._keys[id(msg)] = entry
        return entry

    def _process_message(self, msg: dict) -> None:
        if msg["type"] == "sample":
            self._site_key(msg)
        super()._process_message(msg)

    def _postprocess_message(self, msg: dict) -> None:
        super()._postprocess_message(msg)
        if msg["type"] == "sample":
            key, before = self._keys.pop(id(msg), None) or self._site_key(msg)
            self.sites[key] = RecordedSite(
                msg["value"], bool(msg["is_observed"]), site_is_subsample(msg), before, torch_random_state(self.devices)
            )

    @contextlib.contextmanager
    def replay(
        self, values: Mapping[str, Tensor] | None = None, *, block: bool = True, freeze_batchnorm: bool = True,
        sites: bool = True,
    ) -> Iterator[None]:
        """Run the enclosed code as the recorded run ran (see the module docstring).

        :param values: latent values to use instead of drawing, by site name (every occurrence of the name).
        :param bool block: hide every message of the replay from the enclosing handlers (default).
        :param bool freeze_batchnorm: keep BatchNorm running statistics unchanged (default).
        :param bool sites: replay the recorded sites (subsample indices, outer observations, the random state around
            each site; default). ``False`` only restarts torch's generators where the run started, for code that runs
            on other data (e.g. a subset of the minibatch, whose plates have another size).
        """
        if self.start_state is None:
            raise ValueError("RunRecorder.replay: nothing was recorded (enter the recorder around a run first)")
        frozen = batchnorm_statistics_frozen() if freeze_batchnorm else contextlib.nullcontext()
        with torch.random.fork_rng(devices=self.devices), frozen:
            set_torch_random_state(self.start_state, self.devices)
            with _Replayer(self, {} if values is None else values, block, sites):
                yield


class _Replayer(Messenger):
    """The handler behind :meth:`RunRecorder.replay`."""

    def __init__(self, record: RunRecorder, values: Mapping[str, Tensor], block: bool, sites: bool = True) -> None:
        super().__init__()
        self.record = record
        self.recorded = record.sites if sites else {}
        self.values = values
        self.block = block
        self._counts: Counter[str] = Counter()
        self._sites: dict[int, RecordedSite] = {}

    def _process_message(self, msg: dict) -> None:
        if msg["type"] == "sample":
            key = (msg["name"], self._counts[msg["name"]])
            self._counts[msg["name"]] += 1
            site = self.recorded.get(key)
            if site is not None:
                self._sites[id(msg)] = site
                set_torch_random_state(site.state_before, self.record.devices)
            if msg["name"] in self.values:
                msg["value"] = self.values[msg["name"]]
            elif site is not None and (site.is_subsample or site.is_observed and not msg["is_observed"]):
                # observed outside the recorder (blocked here): the recorded observation. A site observed inside the
                # replayed code (by the model, an inner condition, pyro.deterministic, a reparameterisation) already
                # has the value that code gives it now
                msg["value"] = site.value
                msg["is_observed"] = site.is_observed
        if self.block:
            msg["stop"] = True

    def _postprocess_message(self, msg: dict) -> None:
        site = self._sites.pop(id(msg), None)
        if site is not None:
            set_torch_random_state(site.state_after, self.record.devices)


def _replace(obj: Any, table: Mapping[int, Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return table.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        replaced = [_replace(o, table) for o in obj]
        return type(obj)(replaced) if not hasattr(obj, "_fields") else type(obj)(*replaced)
    if isinstance(obj, dict):
        return {k: _replace(v, table) for k, v in obj.items()}
    return obj


class substituted_tensors(TorchFunctionMode):  # noqa: N801 (used like a function: ``with substituted_tensors(...)``)
    """Within the block, every torch operation that receives one of the given tensors receives its replacement
    instead.

    This reaches a guide's parameters however the guide reads them (through ``pyro.param`` and its constraint, as
    a ``PyroModule`` attribute, or inside a network registered with ``pyro.module``), without touching the tensors
    themselves: the first pass's autograd graph stays valid, and gradients reach the original tensors through the
    replacements (e.g. ``phi + delta``).

    :param replacements: pairs ``(tensor, replacement)``; tensors are matched by identity.
    """

    def __init__(self, replacements: Mapping[Tensor, Tensor] | list[tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        pairs = list(replacements.items()) if isinstance(replacements, Mapping) else list(replacements)
        self._keep = pairs  # holds the originals alive, so their ids stay unique
        self._table = {id(original): replacement for original, replacement in pairs}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) == "__get__":  # attribute reads (requires_grad, shape): the original's
            return func(*args, **(kwargs or {}))
        return func(*_replace(args, self._table), **_replace(kwargs or {}, self._table))

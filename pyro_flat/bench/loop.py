r"""The harness's training loop: minibatches, checkpoints, exact resume, divergence, progress and per-epoch logs.

Every method trains through :meth:`Problem.loop <pyro_flat.bench.Problem.loop>`, which makes a :class:`TrainingLoop`
yielding ``(step, (args, kwargs))`` — the model's arguments for that step — and taking care of the rest:

* **minibatches** come from a stream (:mod:`pyro_flat.bench.streams`), one per phase;
* **checkpoints**: every ``every`` steps the loop gives its :class:`~pyro_flat.bench.context.RunContext` what it was
  given to look after — the network, guide, optimizer, schedules, kernel state, collectors (anything with
  ``state_dict``/``load_state_dict``, and Pyro optimizers; :mod:`pyro_flat.bench.state`) — with the random states, the
  batch stream's position, the losses and the epoch log, written to one file atomically
  (:mod:`pyro_flat.bench.files`). A method's loops are numbered (*phases*: an ensemble has one per member); at the end
  of each phase its final state goes to a file of its own.
* **resume**: run the same job again with ``resume=True``. The method's code runs from the start; each loop of a
  finished phase restores that phase's final state (and random state) instead of training, and the interrupted
  loop restores the last checkpoint and continues from its step. Code between loops therefore sees exactly the
  random numbers it saw the first time, and the run ends bit for bit where an uninterrupted one ends (on CPU;
  GPU kernels may not be deterministic).
* **divergence**: a non-finite loss, or a degenerate posterior (a non-finite weight, or a constrained parameter
  outside its support: a guide's scale that underflowed to 0), raises a ``FloatingPointError`` naming the step; both
  are checked every ``log_every`` steps with the one host read that logs the loss. A checkpoint is written only
  after checking that every floating tensor in it is finite, so the last good checkpoint is never overwritten by a
  diverged state (the error names it).
* **signals**: within :func:`~pyro_flat.bench.signals.stop_on_signals`, a SIGINT or SIGTERM stops the loop before
  its next step (:class:`~pyro_flat.bench.signals.Interrupted`), after writing a checkpoint there when the job keeps
  checkpoints.
* **progress and logs**: a tqdm bar per loop (rate and ETA) and one JSON line per epoch (mean loss, steps, time).

The loop knows nothing of the problem it trains on: it is given a stream factory, its number of steps, the steps
of an epoch and the device its checkpoints are read onto. The names of the files, streams, state and context modules
are importable from here too, where they were before the split.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .context import RunContext, check_fingerprint
from .files import (
    CHECKPOINT_FORMAT,
    TEMPORARY,
    CheckpointError,
    OutputFolderError,
    atomic_save,
    atomic_write_text,
    load_checkpoint,
    metrics_log_writer,
    output_lock,
    remove_stale_temporaries,
)
from .signals import Interrupted, should_stop
from .state import Holder, first_degenerate, get_state, healthy, move_tensors, random_state, set_random_state, set_state
from .streams import Batch, LoaderStream, TensorStream, stream_seed

__all__ = [
    "CHECKPOINT_FORMAT",
    "TEMPORARY",
    "Batch",
    "CheckpointError",
    "Holder",
    "LoaderStream",
    "OutputFolderError",
    "RunContext",
    "TensorStream",
    "TrainingLoop",
    "atomic_save",
    "atomic_write_text",
    "check_fingerprint",
    "load_checkpoint",
    "metrics_log_writer",
    "output_lock",
    "remove_stale_temporaries",
    "stream_seed",
]


class TrainingLoop:
    """``num_steps`` steps of one phase of a method (see the module docstring); made by ``Problem.loop``.

    :param context: the job's checkpoints, resume, progress and log.
    :param num_steps: the steps of this phase.
    :param state: ``{name: object}`` — everything this phase changes that later code reads (network, guide, optimizer,
        schedule, collector, kernel, ...), each with ``state_dict``/``load_state_dict`` (or a Pyro optimizer).
    :param stream: ``stream(phase)`` makes the phase's minibatch stream (``next(stream)`` gives ``(args, kwargs)``;
        ``state_dict`` for its position).
    :param steps_per_epoch: the steps of one pass over the training set (an epoch's log entry closes after each).
    :param device: where the tensors of a restored checkpoint go (the run's device; checkpoints are read onto the
        CPU).
    :param prepare: called with one batch as ``prepare(*args, **kwargs)`` before a state is restored, to create what
        is created lazily (an autoguide's parameters).
    :param log_every: keep every ``log_every``-th loss in :attr:`history`.
    :param name: shown in the progress bar.
    """

    def __init__(
        self,
        context: RunContext,
        num_steps: int,
        state: Mapping[str, object],
        stream: Callable[[int], TensorStream | LoaderStream],
        *,
        steps_per_epoch: int,
        device: torch.device,
        prepare: Callable[..., object] | None = None,
        log_every: int = 50,
        name: str = "",
    ) -> None:
        if not (isinstance(num_steps, int) and num_steps >= 0):
            raise ValueError(f"`num_steps` must be an int >= 0, got {num_steps!r}")
        if not (isinstance(steps_per_epoch, int) and steps_per_epoch >= 1):
            raise ValueError(f"`steps_per_epoch` must be an int >= 1, got {steps_per_epoch!r}")
        self.context, self.num_steps, self.state, self._make_stream = context, num_steps, dict(state), stream
        self.steps_per_epoch, self.device = steps_per_epoch, device
        self.stream: TensorStream | LoaderStream | None = None
        self.prepare, self.log_every, self.name = prepare, log_every, name
        self.history: list[float] = []
        self.step = -1
        self.phase = -1
        self._epoch_sum: Tensor | float = 0.0
        self._epoch_count = 0
        self._epoch_start = time.perf_counter()

    # -- what is saved ------------------------------------------------------------------------------------------------

    def _snapshot(self, step: int) -> dict:
        return {
            "phase": self.phase,
            "step": step,
            "state": {name: get_state(obj) for name, obj in self.state.items()},
            "stream": self.stream.state_dict(),
            "rng": random_state(),
            "history": list(self.history),
            "epoch_sum": self._epoch_sum,
            "epoch_count": self._epoch_count,
            "entries": list(self.context.entries),
        }

    def _restore(self, saved: Mapping) -> int:
        if self.prepare is not None:
            args, kwargs = next(self.stream)
            self.prepare(*args, **kwargs)
        missing = set(self.state) ^ set(saved["state"])
        if missing:
            raise ValueError(f"{self.context.label}: the checkpoint of phase {self.phase} holds "
                             f"{sorted(saved['state'])}, the method now has {sorted(self.state)}")
        state = move_tensors(saved["state"], self.device)  # checkpoints are read onto the CPU
        for name, obj in self.state.items():
            set_state(obj, state[name])
        self.stream.load_state_dict(saved["stream"])
        set_random_state(saved["rng"])
        self.history = list(saved["history"])
        self._epoch_sum = move_tensors(saved["epoch_sum"], self.device)
        self._epoch_count = saved["epoch_count"]
        self.context.entries[:] = saved["entries"]
        return saved["step"]

    # -- the steps ----------------------------------------------------------------------------------------------------

    def record(self, loss: float | Tensor) -> None:
        """Record this step's loss: a Python number is checked at once, a tensor (no host read) every ``log_every``
        steps and at the end of an epoch. Every ``log_every`` steps the state is checked too
        (:func:`~pyro_flat.bench.state.healthy`), in the same host read as the loss. A NaN or an infinity, or a
        degenerate state, raises ``FloatingPointError`` naming the step."""
        self._epoch_sum = self._epoch_sum + (loss.detach() if isinstance(loss, Tensor) else loss)
        self._epoch_count += 1
        step, last = self.step, self.num_steps - 1
        logged = step % self.log_every == 0 or step == last
        if isinstance(loss, Tensor) and not logged:
            return
        ok = healthy(self.state) if logged else None
        checked = loss if ok is None else torch.where(ok, torch.as_tensor(loss, device=ok.device), math.nan)
        where = f"at step {step} of {self.num_steps}" + (f" (phase {self.phase})" if self.phase else "")
        value = float(checked)  # one host read for the loss and the state
        if not math.isfinite(value):
            value = float(loss)
            what = f"the loss became {value}" if not math.isfinite(value) else first_degenerate(self.state)
            raise FloatingPointError(f"{self.context.label}: {what} {where}")
        if logged:
            self.history.append(value)

    def _end_epoch(self, step: int) -> None:
        ctx = self.context
        seconds = time.perf_counter() - self._epoch_start
        mean = float(self._epoch_sum) / self._epoch_count if self._epoch_count else None
        if mean is not None and not math.isfinite(mean):
            raise FloatingPointError(f"{ctx.label}: the mean loss of the epoch ending at step {step} is {mean}")
        entry = {"job": ctx.label, "phase": self.phase, "epoch": (step + 1) // self.steps_per_epoch,
                 "step": step + 1, "loss": mean, "seconds": round(seconds, 3), "loop": self.name}
        ctx.entries.append(entry)
        if ctx.log is not None and ctx.is_writer:
            ctx.log(entry)
        self._epoch_sum, self._epoch_count, self._epoch_start = 0.0, 0, time.perf_counter()

    def _stop(self, signum: int, step: int) -> None:
        """End the run before ``step`` for a signal, saving a checkpoint there when the job keeps them."""
        ctx = self.context
        checkpoint = None
        if ctx.directory is not None:
            ctx.save(self._snapshot(step), complete=False)
            checkpoint = ctx.checkpoint_path
        raise Interrupted(signum, f"in {ctx.label} before step {step} of {self.num_steps}", checkpoint)

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        ctx = self.context
        self.phase = ctx.next_phase()
        ctx.current = self
        self.stream = self._make_stream(self.phase)
        start = 0
        saved = ctx.restore_point(self.phase)
        if saved is not None:
            start = self._restore(saved)
        if start >= self.num_steps:
            return
        spe = self.steps_per_epoch
        bar = tqdm(total=self.num_steps, initial=start, disable=not (ctx.progress and ctx.is_writer), leave=False,
                   desc=f"{ctx.label} {self.name}".strip(), unit="step", dynamic_ncols=True)
        try:
            for step in range(start, self.num_steps):
                signum = should_stop(step, self.log_every)
                if signum is not None:
                    self._stop(signum, step)
                if step > start and ctx.every and step % ctx.every == 0:
                    ctx.save(self._snapshot(step), complete=False)
                self.step = step
                yield step, next(self.stream)
                bar.update()
                if (step + 1) % spe == 0 or step == self.num_steps - 1:
                    self._end_epoch(step)
        finally:
            bar.close()
        ctx.save(self._snapshot(self.num_steps), complete=True)

r"""The harness's training loops: minibatches, checkpoints, exact resume, divergence, progress and per-epoch logs.

Every method trains through :meth:`Problem.loop <pyro_flat.bench.Problem.loop>`, which yields ``(step, (args,
kwargs))`` — the model's arguments for that step — and takes care of the rest:

* **minibatches** (:class:`TensorStream`, :class:`LoaderStream`): tensor data keep the in-model subsampling path
  (``(x_train, y_train), {"subsample_size": B}``; the model's plate draws the indices), or, for methods that need the
  batch itself, ``(x[idx], y[idx]), {"num_data": N}``; image data with augmentation come from a ``DataLoader``
  (:meth:`~pyro_flat.data.VisionData.train_batches`) as ``(x, y), {"num_data": N}``. Under ``torch.distributed`` each
  rank gets its equal shard of the same global batch.
* **checkpoints** (:class:`RunContext`): every ``every`` steps the loop saves what it was given to look after — the
  network, guide, optimizer, schedules, kernel state, collectors (anything with ``state_dict``/``load_state_dict``,
  and Pyro optimizers) — with the random states, the batch stream's position, the losses and the epoch log, to one
  file written atomically (``torch.save`` to a temporary file, then ``os.replace``). A method's loops are numbered
  (*phases*: an ensemble has one per member); at the end of each phase its final state goes to a file of its own.
* **resume**: run the same job again with ``resume=True``. The method's code runs from the start; each loop of a
  finished phase restores that phase's final state (and random state) instead of training, and the interrupted
  loop restores the last checkpoint and continues from its step. Code between loops therefore sees exactly the
  random numbers it saw the first time, and the run ends bit for bit where an uninterrupted one ends (on CPU;
  GPU kernels may not be deterministic).
* **divergence**: a non-finite loss raises a ``FloatingPointError`` naming the step; a checkpoint is written only
  after checking that every floating tensor in it is finite, so the last good checkpoint is never overwritten by a
  diverged state (the error names it).
* **progress and logs**: a tqdm bar per loop (rate and ETA) and one JSON line per epoch (mean loss, steps, time).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pyro
import pyro.optim
import torch
from torch import Tensor
from tqdm.auto import tqdm

from .._validation import all_true
from ..data import ClassificationData
from ..data.images import VisionData, combined_seed
from ..distributed import shard_size

if TYPE_CHECKING:
    from .problem import Problem

__all__ = [
    "DrawStore",
    "Holder",
    "LoaderStream",
    "RunContext",
    "TensorStream",
    "TrainingLoop",
    "atomic_save",
    "atomic_write_text",
]

Batch = tuple[tuple[Tensor, ...], dict[str, Any]]


# ---------------------------------------------------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------------------------------------------------


def _atomic_write(path: Path, write: Callable[[IO], object], mode: str) -> None:
    """``write(handle)`` to a temporary file in ``path``'s folder, flushed to disk, then ``os.replace`` d over
    ``path``: a kill during the write leaves the previous file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_write_text`)."""
    _atomic_write(path, lambda handle: torch.save(obj, handle), "wb")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: to a temporary file in the same folder, flushed to disk, then
    ``os.replace`` d over ``path`` — a kill during the write leaves the previous file intact."""
    _atomic_write(path, lambda handle: handle.write(text), "w")


# ---------------------------------------------------------------------------------------------------------------------
# minibatch streams
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class TensorStream:
    """Minibatches of in-memory tensor data.

    Without ``explicit`` (one process): the whole training set with ``subsample_size=B`` (the model's
    ``pyro.plate`` draws the minibatch). Otherwise ``idx = randperm(N)[:B]`` from torch's global generator (the
    plate's own draw), this rank's shard of it, and ``num_data=N``. Its randomness is torch's global state, which the
    checkpoints hold, so it has no state of its own.
    """

    data: ClassificationData
    batch_size: int
    explicit: bool = False
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        self._shard = shard_size(self.batch_size, self.world_size)

    def __next__(self) -> Batch:
        data = self.data
        if not self.explicit:
            return (data.x_train, data.y_train), {"subsample_size": self.batch_size}
        idx = torch.randperm(data.num_data, device=data.device)[: self.batch_size]
        shard = self._shard
        idx = idx[self.rank * shard : (self.rank + 1) * shard]
        return (data.x_train[idx], data.y_train[idx]), {"num_data": data.num_data}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Nothing to restore: the stream's randomness is torch's global state, restored with the checkpoint."""


class LoaderStream:
    """Augmented image minibatches from :meth:`VisionData.train_batches <pyro_flat.data.VisionData.train_batches>`,
    epoch after epoch, moved to the run's device (``non_blocking`` from pinned memory, optionally channels-last) and
    reshaped to the data's input shape; yields ``(x, y), {"num_data": N}``. Its state is ``(epoch, batches consumed in
    the epoch)``: the batches themselves are a pure function of the seed and that position.
    """

    def __init__(
        self,
        data: VisionData,
        batch_size: int,
        seed: int,
        *,
        augment: bool = True,
        num_workers: int = 0,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        self.data, self.batch_size, self.seed, self.drop_last = data, batch_size, seed, drop_last
        self.augment, self.num_workers, self.channels_last = augment, num_workers, channels_last
        self.rank, self.world_size = rank, world_size
        self.epoch, self.batch = 0, 0
        self._batches: Iterator | None = None

    def _open(self) -> Iterator:
        return iter(self.data.train_batches(
            self.batch_size, seed=self.seed, epoch=self.epoch, start=self.batch, augment=self.augment,
            num_workers=self.num_workers, pin_memory=self.data.device.type == "cuda",
            drop_last=self.drop_last, rank=self.rank, world_size=self.world_size,
        ))

    def __next__(self) -> Batch:
        if self._batches is None:
            self._batches = self._open()
        try:
            x, y = next(self._batches)
        except StopIteration:
            self.epoch, self.batch = self.epoch + 1, 0
            self._batches = self._open()
            x, y = next(self._batches)
        self.batch += 1
        data = self.data
        x = x.to(data.device, non_blocking=True).to(data.dtype).reshape(len(x), *data.input_shape)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return (x, y.to(data.device, non_blocking=True)), {"num_data": data.num_data}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: Mapping) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._batches = None


# ---------------------------------------------------------------------------------------------------------------------
# state of the objects a loop looks after
# ---------------------------------------------------------------------------------------------------------------------


def _get_state(obj: object) -> object:
    if isinstance(obj, pyro.optim.PyroOptim):
        # states loaded but not yet consumed (no step since the resume) are part of the state
        return {**getattr(obj, "_state_waiting_to_be_consumed", {}), **obj.get_state()}
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}: it has no state_dict()")


def _set_state(obj: object, state: object) -> None:
    if isinstance(obj, pyro.optim.PyroOptim):
        obj.set_state(state)
    else:
        obj.load_state_dict(state)


def _random_state() -> dict:
    state = pyro.util.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_random_state(state: Mapping) -> None:
    pyro.util.set_rng_state(dict(state))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_device(obj: object, device: torch.device) -> object:
    """``obj`` (nested dicts, lists and tuples) with its tensors moved to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _floating_tensors(obj: object, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        if obj.is_floating_point():
            yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _floating_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _floating_tensors(value, f"{prefix}[{i}]")


def _first_non_finite(state: Mapping) -> str | None:
    """The name of the first floating tensor of ``state`` holding a NaN or an infinity (one host read if none)."""
    tensors = list(_floating_tensors(state))
    if not tensors:
        return None
    flags = [t.isfinite().all() for _, t in tensors]
    if all_true(flags):
        return None
    return next(name for (name, _), ok in zip(tensors, flags, strict=True) if not bool(ok))


class Holder:
    """A value a loop changes (e.g. a chain's parameters), checkpointed as is."""

    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping) -> None:
        self.value = state["value"]


class DrawStore:
    """The posterior draws a loop collects: kept in memory and, with a ``directory``, each written once to its own
    file (``draw_000000.pt``, ...), so that a checkpoint holds only their number, not the weights of every draw.

    :param directory: where the draw files go (``None``: the checkpoints hold the draws themselves).
    :param writer: whether this process writes files.
    :param device: where draws read back from the files go.
    """

    def __init__(self, directory: Path | None, *, writer: bool = True, device: torch.device | None = None) -> None:
        self.directory, self.writer, self.device = directory, writer, device
        self.draws: list[dict[str, Tensor]] = []
        if directory is not None and writer:
            Path(directory).mkdir(parents=True, exist_ok=True)

    def _path(self, k: int) -> Path:
        return Path(self.directory) / f"draw_{k:06d}.pt"

    def add(self, draw: dict[str, Tensor]) -> None:
        if self.directory is not None and self.writer:
            atomic_save(draw, self._path(len(self.draws)))
        self.draws.append(draw)

    def state_dict(self) -> dict:
        return {"count": len(self.draws)} if self.directory is not None else {"draws": list(self.draws)}

    def load_state_dict(self, state: Mapping) -> None:
        if "draws" in state:
            self.draws = list(state["draws"])
        else:
            self.draws = [torch.load(self._path(k), map_location=self.device, weights_only=True)
                          for k in range(state["count"])]


# ---------------------------------------------------------------------------------------------------------------------
# one job's checkpoints
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class RunContext:
    """Checkpointing, resuming, progress and logging of one harness job (a method on a dataset with a seed).

    :param label: names the job in messages and logs (``"cifar10/vi/seed 0"``).
    :param directory: where the job's checkpoints live (``None``: no checkpoints, no resume).
    :param every: steps between two checkpoints of a loop (0: only the end of each phase).
    :param resume: continue from the checkpoints in ``directory``.
    :param progress: show a tqdm bar per loop.
    :param log: called with every per-epoch entry (e.g. to append it to a JSON-lines file).
    :param is_writer: whether this process writes files (rank 0 under ``torch.distributed``).
    :param fingerprint: a description of the run (its configuration); a resume refuses checkpoints of another one.
    """

    label: str = ""
    directory: Path | None = None
    every: int = 0
    resume: bool = False
    progress: bool = False
    log: Callable[[dict], None] | None = None
    is_writer: bool = True
    fingerprint: dict = field(default_factory=dict)
    entries: list[dict] = field(default_factory=list)
    num_saves: int = 0
    current: TrainingLoop | None = None
    _phase: int = -1
    _saved: dict | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.every, int) and self.every >= 0):
            raise ValueError(f"checkpoint `every` must be an int >= 0, got {self.every!r}")
        if self.directory is None:
            if self.resume:
                raise ValueError("resume=True needs a checkpoint directory")
            return
        self.directory = Path(self.directory)
        if self.is_writer:
            self.directory.mkdir(parents=True, exist_ok=True)
        if self.resume and self.checkpoint_path.exists():
            self._saved = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
            self._check_fingerprint(self._saved)
            self.num_saves = self._saved["num_saves"]

    @property
    def restored_entries(self) -> list[dict]:
        """The per-epoch entries recorded up to the checkpoint a resume starts from (none otherwise)."""
        return [] if self._saved is None else list(self._saved["entries"])

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / "checkpoint.pt"

    def phase_path(self, phase: int) -> Path:
        return self.directory / f"phase_{phase}.pt"

    def _check_fingerprint(self, saved: Mapping) -> None:
        if saved.get("fingerprint") != self.fingerprint:
            theirs, ours = saved.get("fingerprint", {}), self.fingerprint
            changed = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise ValueError(
                f"{self.label}: the checkpoints in {self.directory} belong to another configuration (differences in "
                f"{changed}); resume with the same arguments, or use another output folder"
            )

    def next_phase(self) -> int:
        self._phase += 1
        return self._phase

    def restore_point(self, phase: int) -> dict | None:
        """The saved state to start phase ``phase`` from: its final state if it finished, the last checkpoint if it
        was interrupted, else ``None``."""
        if not self.resume or self.directory is None:
            return None
        path = self.phase_path(phase)
        if path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=False)
            self._check_fingerprint(saved)
            return saved
        if self._saved is not None and self._saved["phase"] == phase:
            return self._saved
        return None

    def save(self, snapshot: dict, *, complete: bool) -> None:
        """Write a checkpoint (``complete``: the phase's final state) after checking that it is finite."""
        if self.directory is None or not self.is_writer:
            return
        bad = _first_non_finite(snapshot["state"])
        if bad is not None:
            where = f"{self.checkpoint_path} ({self.num_saves} saves)" if self.num_saves else "no checkpoint yet"
            raise FloatingPointError(
                f"{self.label}: {bad} is NaN or infinite at step {snapshot['step']} of phase {snapshot['phase']}; "
                f"the checkpoint was not written, the last good one is kept: {where}"
            )
        self.num_saves += 1
        snapshot = snapshot | {"fingerprint": self.fingerprint, "num_saves": self.num_saves}
        atomic_save(snapshot, self.phase_path(snapshot["phase"]) if complete else self.checkpoint_path)
        if complete:  # the rolling checkpoint follows, so that it always names the newest state
            atomic_save(snapshot, self.checkpoint_path)

    def diverged(self, error: Exception) -> str | None:
        """Where the running loop diverged (phase, step and the first non-finite tensor of its state, if any), or
        ``None`` if ``error`` is not a divergence: called when training raised a ``ValueError`` — Pyro's validation
        rejects non-finite values (e.g. logits that overflowed) before any loss is seen."""
        loop = self.current
        if loop is None:
            return None
        bad = _first_non_finite({name: _get_state(obj) for name, obj in loop.state.items()})
        text = str(error)
        if bad is None and not ("invalid values" in text and ("nan" in text or "inf" in text)):
            return None
        what = "non-finite values in the model" if bad is None else f"{bad} is NaN or infinite"
        return f"{what} at step {loop.step} of {loop.num_steps} (phase {loop.phase})"

    def last_good(self) -> str:
        """Where the last good checkpoint is (for error messages)."""
        if self.directory is None or self.num_saves == 0:
            return "no checkpoint was written (checkpoints are off or none was due yet)"
        return f"the last good checkpoint is kept in {self.checkpoint_path}"


# ---------------------------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------------------------


class TrainingLoop:
    """``num_steps`` steps of one phase of a method (see the module docstring); made by ``Problem.loop``.

    :param problem: the harness problem (data, configuration, run context).
    :param num_steps: the steps of this phase.
    :param state: ``{name: object}`` — everything this phase changes that later code reads (network, guide, optimizer,
        schedule, collector, kernel, ...), each with ``state_dict``/``load_state_dict`` (or a Pyro optimizer).
    :param stream: ``stream(phase)`` makes the phase's minibatch stream (``next(stream)`` gives ``(args, kwargs)``;
        ``state_dict`` for its position).
    :param prepare: called with one batch as ``prepare(*args, **kwargs)`` before a state is restored, to create what
        is created lazily (an autoguide's parameters).
    :param log_every: keep every ``log_every``-th loss in :attr:`history`.
    :param name: shown in the progress bar.
    """

    def __init__(
        self,
        problem: Problem,
        num_steps: int,
        state: Mapping[str, object],
        stream: Callable[[int], TensorStream | LoaderStream],
        *,
        prepare: Callable[..., object] | None = None,
        log_every: int = 50,
        name: str = "",
    ) -> None:
        if not (isinstance(num_steps, int) and num_steps >= 0):
            raise ValueError(f"`num_steps` must be an int >= 0, got {num_steps!r}")
        self.problem, self.num_steps, self.state, self._make_stream = problem, num_steps, dict(state), stream
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
            "state": {name: _get_state(obj) for name, obj in self.state.items()},
            "stream": self.stream.state_dict(),
            "rng": _random_state(),
            "history": list(self.history),
            "epoch_sum": self._epoch_sum,
            "epoch_count": self._epoch_count,
            "entries": list(self.problem.context.entries),
        }

    def _restore(self, saved: Mapping) -> int:
        if self.prepare is not None:
            args, kwargs = next(self.stream)
            self.prepare(*args, **kwargs)
        missing = set(self.state) ^ set(saved["state"])
        if missing:
            raise ValueError(f"{self.problem.context.label}: the checkpoint of phase {self.phase} holds "
                             f"{sorted(saved['state'])}, the method now has {sorted(self.state)}")
        state = _to_device(saved["state"], self.problem.data.device)  # checkpoints are read onto the CPU
        for name, obj in self.state.items():
            _set_state(obj, state[name])
        self.stream.load_state_dict(saved["stream"])
        _set_random_state(saved["rng"])
        self.history = list(saved["history"])
        self._epoch_sum = _to_device(saved["epoch_sum"], self.problem.data.device)
        self._epoch_count = saved["epoch_count"]
        self.problem.context.entries[:] = saved["entries"]
        return saved["step"]

    # -- the steps ----------------------------------------------------------------------------------------------------

    def record(self, loss: float | Tensor) -> None:
        """Record this step's loss: a Python number is checked at once, a tensor (no host read) every ``log_every``
        steps and at the end of an epoch; a NaN or an infinity raises ``FloatingPointError`` naming the step."""
        self._epoch_sum = self._epoch_sum + (loss.detach() if isinstance(loss, Tensor) else loss)
        self._epoch_count += 1
        step, last = self.step, self.num_steps - 1
        if isinstance(loss, Tensor) and not (step % self.log_every == 0 or step == last):
            return
        value = float(loss)
        if not math.isfinite(value):
            raise FloatingPointError(
                f"{self.problem.context.label}: the loss became {value} at step {step} of {self.num_steps}"
                + (f" (phase {self.phase})" if self.phase else "")
            )
        if step % self.log_every == 0 or step == last:
            self.history.append(value)

    def _end_epoch(self, step: int) -> None:
        ctx = self.problem.context
        seconds = time.perf_counter() - self._epoch_start
        mean = float(self._epoch_sum) / self._epoch_count if self._epoch_count else None
        if mean is not None and not math.isfinite(mean):
            raise FloatingPointError(f"{ctx.label}: the mean loss of the epoch ending at step {step} is {mean}")
        entry = {"job": ctx.label, "phase": self.phase, "epoch": (step + 1) // self.problem.steps_per_epoch,
                 "step": step + 1, "loss": mean, "seconds": round(seconds, 3), "loop": self.name}
        ctx.entries.append(entry)
        if ctx.log is not None and ctx.is_writer:
            ctx.log(entry)
        self._epoch_sum, self._epoch_count, self._epoch_start = 0.0, 0, time.perf_counter()

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        ctx = self.problem.context
        self.phase = ctx.next_phase()
        ctx.current = self
        self.stream = self._make_stream(self.phase)
        start = 0
        saved = ctx.restore_point(self.phase)
        if saved is not None:
            start = self._restore(saved)
        if start >= self.num_steps:
            return
        spe = self.problem.steps_per_epoch
        bar = tqdm(total=self.num_steps, initial=start, disable=not (ctx.progress and ctx.is_writer), leave=False,
                   desc=f"{ctx.label} {self.name}".strip(), unit="step", dynamic_ncols=True)
        try:
            for step in range(start, self.num_steps):
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


def stream_seed(seed: int, phase: int) -> int:
    """The seed of a loader stream for phase ``phase`` of a job with seed ``seed`` (independent across phases)."""
    return combined_seed(seed, phase, 0x5EED)


def metrics_log_writer(path: Path) -> Callable[[dict], None]:
    """A ``RunContext.log`` appending each entry to ``path`` as one JSON line."""

    def write(entry: dict) -> None:
        with open(path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    return write

r"""The harness's training loops: minibatches, checkpoints, exact resume, divergence, progress and per-epoch logs.

Every method trains through :meth:`Problem.loop <pyro_flat.bench.Problem.loop>`, which yields ``(step, (args,
kwargs))`` — the model's arguments for that step — and takes care of the rest:

* **minibatches** (:class:`TensorStream`, :class:`LoaderStream`): tensor data keep the in-model subsampling path
  (``(x_train, y_train), {"subsample_size": B}``; the model's plate draws the indices), or, for methods that need the
  batch itself, ``(x[idx], y[idx]), {"num_data": N}``; image data with augmentation are augmented batch by batch on
  the run's device (:class:`~pyro_flat.data.images.DeviceBatches`, or ``DataLoader`` workers on the CPU) and come as
  ``(x, y), {"num_data": N}``. Under ``torch.distributed`` each rank gets its equal shard of the same global batch.
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

import hashlib
import json
import math
import os
import pickle
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import pyro
import pyro.optim
import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from .._validation import all_true
from ..data import ClassificationData
from ..data.images import DeviceBatches, VisionData, combined_seed
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
    "CheckpointError",
    "OutputFolderError",
    "atomic_save",
    "atomic_write_text",
    "load_checkpoint",
    "output_lock",
]

Batch = tuple[tuple[Tensor, ...], dict[str, Any]]


# ---------------------------------------------------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------------------------------------------------


TEMPORARY = re.compile(r"^\..+\.tmp\d+$")
"""The name of a temporary file of :func:`_atomic_write` (``.<name>.tmp<pid>``)."""


class OutputFolderError(ValueError):
    """A run refused before it starts because of its output folder: another run is writing to it, or it holds
    checkpoints that only ``--resume`` may continue."""


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files that writes killed midway left under ``folder`` (call it while holding the folder's
    :func:`output_lock`: no other writer can be using them); returns what was removed."""
    stale = [path for path in Path(folder).rglob(".*.tmp*") if TEMPORARY.match(path.name) and path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


@contextmanager
def output_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock (the file ``folder/.lock``, an OS lock released when the process ends, even by SIGKILL)
    for the duration of a run, so that one run at a time writes there; on entry, remove the temporary files of writes
    killed midway (:func:`remove_stale_temporaries`). Under ``torch.distributed`` rank 0 (the writer) takes the lock
    and tells the other ranks whether it could (a collective: every rank enters).

    :raises OutputFolderError: on every rank, if another process holds the lock.
    """
    from filelock import FileLock, Timeout

    folder = Path(folder)
    distributed = dist.is_available() and dist.is_initialized()
    lock, refusal = None, None
    if not distributed or dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(folder / ".lock", timeout=0)
        try:
            lock.acquire()
        except Timeout:
            lock, refusal = None, (
                f"another run is writing to {folder} (it holds {folder / '.lock'}): two runs in one folder would "
                "lose each other's results; wait for it to end, or choose another output folder")
    if distributed:
        message = [refusal]
        dist.broadcast_object_list(message, src=0)
        refusal = message[0]
    if refusal is not None:
        raise OutputFolderError(refusal)
    try:
        if lock is not None:
            remove_stale_temporaries(folder)
        yield
    finally:
        if lock is not None:
            lock.release()


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


CHECKPOINT_FORMAT = "pyro_flat checkpoint 1"
"""The format tag of the files :func:`atomic_save` writes."""


class CheckpointError(ValueError):
    """A file of the harness that cannot be used — damaged, truncated, crafted, or not written by
    :func:`atomic_save` — with a message naming it."""


def _checksum(obj: object) -> str:
    """SHA-256 of ``obj``'s content: each tensor's dtype, shape and bytes, and every other value's ``repr``, walked in
    order through dicts, lists and tuples (what a weights-only ``torch.load`` gives back)."""
    digest = hashlib.sha256()

    def walk(value: object) -> None:
        if isinstance(value, Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"<{value.dtype} {tuple(value.shape)}>".encode())
            digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
        elif isinstance(value, Mapping):
            digest.update(b"{")
            for key, item in value.items():
                digest.update(repr(key).encode() + b":")
                walk(item)
            digest.update(b"}")
        elif isinstance(value, (list, tuple)):
            digest.update(b"[" if isinstance(value, list) else b"(")
            for item in value:
                walk(item)
            digest.update(b"]")
        else:
            digest.update(repr(value).encode() + b",")

    walk(obj)
    return digest.hexdigest()


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_write_text`), with a checksum of its content;
    read it back with :func:`load_checkpoint`. ``obj`` must hold only tensors and plain Python values (dicts,
    lists, tuples, numbers, strings, ``None``): what ``torch.load(weights_only=True)`` reads."""
    payload = {"format": CHECKPOINT_FORMAT, "sha256": _checksum(obj), "content": obj}
    _atomic_write(path, lambda handle: torch.save(payload, handle), "wb")


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """What :func:`atomic_save` wrote to ``path``, read with ``torch.load(weights_only=True)`` — a crafted file
    cannot run code — after checking its checksum.

    :raises CheckpointError: naming the file, if it cannot be read (truncated, damaged), holds anything but tensors
        and plain values (refused unread), is not a file of :func:`atomic_save`, or its content does not match its
        checksum (a flipped bit).
    """
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[-1].strip()
        raise CheckpointError(
            f"{path}: refused: the file holds more than tensors and plain values, which torch.load(weights_only=True)"
            f" does not run ({first}); it was not written by pyro_flat (crafted, or from another program)"
        ) from error
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises RuntimeError, EOFError, ... for a truncated or damaged archive
        raise CheckpointError(f"{path}: cannot be read: truncated or damaged ({type(error).__name__}: "
                              f"{str(error).strip().splitlines()[0] if str(error).strip() else ''})") from error
    if not (isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT and "content" in payload):
        raise CheckpointError(f"{path}: not a checkpoint of pyro_flat (expected format {CHECKPOINT_FORMAT!r}); "
                              "it may come from an older version: rerun without --resume in a new output folder")
    if _checksum(payload["content"]) != payload.get("sha256"):
        raise CheckpointError(f"{path}: damaged: its content does not match the checksum written with it (a "
                              "flipped bit, a partial copy); restore the file or rerun without it")
    return payload["content"]


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
    """Augmented image minibatches, epoch after epoch, on the run's device (optionally channels-last) and reshaped to
    the data's input shape; yields ``(x, y), {"num_data": N}``. With ``num_workers=0`` they are built on the device
    (:class:`~pyro_flat.data.images.DeviceBatches`: a GPU augments the whole batch at once), else on the CPU by
    ``num_workers`` ``DataLoader`` workers (:meth:`VisionData.train_batches
    <pyro_flat.data.VisionData.train_batches>`) and copied ``non_blocking`` from pinned memory; the batches are the
    same. Its state is ``(epoch, batches consumed in the epoch)``: the batches themselves are a pure function of the
    seed and that position, and building them draws nothing from torch's global random state.
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
        self._on_device = None if num_workers else DeviceBatches(data)

    def _open(self) -> Iterator:
        position = {"seed": self.seed, "epoch": self.epoch, "start": self.batch, "augment": self.augment,
                    "drop_last": self.drop_last, "rank": self.rank, "world_size": self.world_size}
        if self._on_device is not None:
            return self._on_device.epoch(self.batch_size, **position)
        return iter(self.data.train_batches(self.batch_size, num_workers=self.num_workers,
                                            pin_memory=self.data.device.type == "cuda", **position))

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
    """torch's, Python's, NumPy's (its key as an int64 tensor, so that a weights-only load reads it) and CUDA's
    random states."""
    state = pyro.util.get_rng_state()
    name, key, position, has_gauss, cached = state["numpy"]
    state["numpy"] = (name, torch.from_numpy(key.astype(np.int64)), int(position), int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_random_state(state: Mapping) -> None:
    name, key, position, has_gauss, cached = state["numpy"]
    pyro.util.set_rng_state({**state, "numpy": (name, key.numpy().astype(np.uint32), position, has_gauss, cached)})
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
            self.draws = [load_checkpoint(self._path(k), map_location=self.device) for k in range(state["count"])]


# ---------------------------------------------------------------------------------------------------------------------
# one job's checkpoints
# ---------------------------------------------------------------------------------------------------------------------


def check_fingerprint(label: str, path: Path, theirs: Mapping | None, ours: Mapping) -> None:
    """Refuse a file written by a job configured differently from this one.

    :param label: the job, for the message.
    :param path: the file (checkpoint, phase, record) whose fingerprint is ``theirs``.
    :raises ValueError: naming every key that differs, with both values.
    """
    theirs = {} if theirs is None else theirs
    if dict(theirs) == dict(ours):
        return
    def show(values: Mapping, key: str) -> str:
        return repr(values[key]) if key in values else "absent"

    changed = [f"{key} was {show(theirs, key)}, now {show(ours, key)}" for key in sorted(set(theirs) | set(ours))
               if key not in theirs or key not in ours or theirs[key] != ours[key]]
    raise ValueError(
        f"{label}: {path} belongs to another configuration ({'; '.join(changed)}); resume with the same "
        f"arguments, or use another output folder"
    )



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
    :param fingerprint: what determines the job's results (a flat dict, see
        :func:`~pyro_flat.bench.runner.job_fingerprint`); a resume refuses checkpoints of another one, naming the keys
        that differ.
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
            self._saved = load_checkpoint(self.checkpoint_path)
            self._check_fingerprint(self._saved, self.checkpoint_path)
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

    def _check_fingerprint(self, saved: Mapping, path: Path) -> None:
        check_fingerprint(self.label, path, saved.get("fingerprint"), self.fingerprint)

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
            saved = load_checkpoint(path)
            self._check_fingerprint(saved, path)
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

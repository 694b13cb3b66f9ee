"""The harness's files: atomic writes, checkpoint files with a checksum, the output folder's lock and the per-epoch
log.

* **atomic writes**: a file is written to a temporary file in its folder (``.<name>.tmp<pid>``), flushed to disk,
  then ``os.replace`` d over the target, so a kill during the write leaves the previous file intact
  (:func:`atomic_save`, :func:`atomic_write_text`);
* **checkpoint files**: :func:`atomic_save` writes tensors and plain values with a SHA-256 of their content;
  :func:`load_checkpoint` reads them back weights-only (a crafted file cannot run code) and refuses a damaged one,
  naming it;
* **one writer per folder**: :func:`output_lock` holds an OS lock on the output folder for a run and removes the
  temporary files of writes killed midway;
* **a full disk** is an ``OSError`` (``ENOSPC``) naming the file whose write failed, whatever raised it (``torch.save``
  reports it as a ``RuntimeError`` of its zip writer, the real cause inside): :func:`disk_full` recognises it;
* **the run's log** (:func:`append_log`): the tracebacks of failed jobs and faults, which the terminal does not show.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "OutputFolderError",
    "append_log",
    "atomic_save",
    "atomic_write_text",
    "disk_full",
    "load_checkpoint",
    "metrics_log_writer",
    "output_lock",
    "remove_stale_temporaries",
]

TEMPORARY = re.compile(r"^\..+\.tmp\d+$")
"""The name of a temporary file of :func:`_atomic_write` (``.<name>.tmp<pid>``)."""


class OutputFolderError(ValueError):
    """A run refused because of its output folder: another run is writing to it, it holds checkpoints that only
    ``--resume`` may continue, or what a resume would read there belongs to another configuration."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def disk_full(error: BaseException) -> OSError | None:
    """The ``OSError`` of a full disk (or quota) among ``error`` and the exceptions it was raised from, or
    ``None``."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NO_SPACE:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _no_space_in(path: Path, error: BaseException) -> OSError:
    """The ``OSError`` to raise for a write of ``path`` that failed on a full disk."""
    full = disk_full(error)
    return OSError(full.errno, os.strerror(full.errno), str(path))


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
            (folder / ".lock").unlink(missing_ok=True)  # while it is held: no other run can be holding it
            lock.release()


def _atomic_write(path: Path, write: Callable[[IO], object], mode: str) -> None:
    """``write(handle)`` to a temporary file in ``path``'s folder, flushed to disk, then ``os.replace`` d over
    ``path``: a kill during the write leaves the previous file intact. On a full disk it raises an ``OSError``
    (``ENOSPC``) naming ``path``; the previous file is intact and the temporary file removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except Exception as error:
        if disk_full(error) is None:
            raise
        raise _no_space_in(path, error) from error
    finally:
        tmp.unlink(missing_ok=True)


CHECKPOINT_FORMAT = "pyro_flat checkpoint 1"
"""The format tag of the files :func:`atomic_save` writes."""


class CheckpointError(ValueError):
    """A file of the harness that cannot be used — damaged, truncated, crafted, or not written by
    :func:`atomic_save` — with a message naming it (:attr:`path`)."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)


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

    :raises CheckpointError: naming the file, if it cannot be read (truncated, damaged, random bytes), holds anything
        but tensors and plain values (refused unread), is not a file of :func:`atomic_save`, or its content does not
        match its checksum (a flipped bit).
    """
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # UnpicklingError, RuntimeError, EOFError, ...: a refused or damaged file
        text = str(error).strip()
        if re.search(r"Unsupported global|not an allowed global", text):  # a pickled function or class: refused
            raise CheckpointError(
                f"{path}: refused: the file holds more than tensors and plain values, which torch.load("
                "weights_only=True) does not run; it was not written by pyro_flat (crafted, or from another "
                "program)", path) from error
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)  # torch's reason, after a page of advice
        detail = found.group(1).strip() if found else (text.splitlines()[0] if text else "")
        raise CheckpointError(f"{path}: cannot be read: truncated or damaged ({type(error).__name__}: {detail})",
                              path) from error
    if not (isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT and "content" in payload):
        raise CheckpointError(f"{path}: not a checkpoint of pyro_flat (expected format {CHECKPOINT_FORMAT!r}); "
                              "it may come from an older version", path)
    if _checksum(payload["content"]) != payload.get("sha256"):
        raise CheckpointError(f"{path}: damaged: its content does not match the checksum written with it (a "
                              "flipped bit, a partial copy)", path)
    return payload["content"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: to a temporary file in the same folder, flushed to disk, then
    ``os.replace`` d over ``path`` — a kill during the write leaves the previous file intact."""
    _atomic_write(path, lambda handle: handle.write(text), "w")


def _append(path: Path, text: str) -> None:
    try:
        with open(path, "a") as handle:
            handle.write(text)
    except OSError as error:
        if disk_full(error) is None:
            raise
        raise _no_space_in(path, error) from error


def metrics_log_writer(path: Path) -> Callable[[dict], None]:
    """A ``RunContext.log`` appending each entry to ``path`` as one JSON line (a full disk: an ``OSError`` naming
    ``path``)."""

    def write(entry: dict) -> None:
        _append(path, json.dumps(entry) + "\n")

    return write


def append_log(path: Path | None, text: str) -> bool:
    """Append ``text`` to the run's log ``path`` (a plain text file) after a time stamp; returns whether it was written
    (not if ``path`` is ``None``, nor on a full disk: the fault it would record is then reported on its own)."""
    if path is None:
        return False
    try:
        _append(Path(path), f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {text.rstrip()}\n")
    except OSError:
        return False
    return True

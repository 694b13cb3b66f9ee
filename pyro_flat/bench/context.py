"""One harness job's checkpoints: where they live, what a resume starts each phase from, which configuration wrote
them (a fingerprint), and where training diverged.

A job's training loops are numbered (*phases*: an ensemble has one per member). :class:`RunContext` writes the
running loop's rolling checkpoint (``checkpoint.pt``) and each finished phase's final state (``phase_<k>.pt``), after
checking that every floating tensor in it is finite, so the last good checkpoint is never overwritten by a diverged
state; on resume it hands each phase the state to start from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .files import OutputFolderError, atomic_save, load_checkpoint
from .state import first_degenerate, first_non_finite, get_state

__all__ = ["RunContext", "RunningLoop", "check_fingerprint"]


class RunningLoop(Protocol):
    """What a :class:`RunContext` reads of the loop it runs (a :class:`~pyro_flat.bench.loop.TrainingLoop`)."""

    state: dict[str, object]
    step: int
    num_steps: int
    phase: int


def check_fingerprint(label: str, path: Path, theirs: Mapping | None, ours: Mapping) -> None:
    """Refuse a file written by a job configured differently from this one.

    :param label: the job, for the message.
    :param path: the file (checkpoint, phase, record) whose fingerprint is ``theirs``.
    :raises OutputFolderError: (a ``ValueError``) naming every key that differs, with both values.
    """
    theirs = {} if theirs is None else theirs
    if dict(theirs) == dict(ours):
        return

    def show(values: Mapping, key: str) -> str:
        return repr(values[key]) if key in values else "absent"

    changed = [f"{key} was {show(theirs, key)}, now {show(ours, key)}" for key in sorted(set(theirs) | set(ours))
               if key not in theirs or key not in ours or theirs[key] != ours[key]]
    raise OutputFolderError(
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
    current: RunningLoop | None = None
    evaluating: bool = False
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
        bad = first_non_finite(snapshot["state"])
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
        """Where the running loop diverged (phase, step and the first non-finite tensor of its state, or a constrained
        parameter outside its support, such as a scale that underflowed to 0), or ``None`` if ``error`` is not a
        divergence: called when training raised a ``ValueError`` — Pyro's validation rejects non-finite values (e.g.
        logits that overflowed) or a zero scale before any loss is seen."""
        loop = self.current
        if loop is None:
            return None
        bad = first_non_finite({name: get_state(obj) for name, obj in loop.state.items()})
        what = f"{bad} is NaN or infinite" if bad is not None else first_degenerate(loop.state)
        text = str(error)
        if what is None and "invalid values" in text and ("nan" in text or "inf" in text):
            what = "non-finite values in the model"
        return None if what is None else f"{what} at step {loop.step} of {loop.num_steps} (phase {loop.phase})"

    def position(self) -> str:
        """Where the job is, for a message: ``"at step 12 of 30 (phase 1)"``, ``"before training"`` or ``"while
        evaluating"``."""
        loop = self.current
        if self.evaluating:
            return "while evaluating"
        if loop is None or loop.step < 0:
            return "before training"
        return f"at step {loop.step} of {loop.num_steps}" + (f" (phase {loop.phase})" if loop.phase else "")

    def last_good(self) -> str:
        """Where the last good checkpoint is (for error messages)."""
        if self.directory is None or self.num_saves == 0:
            return "no checkpoint was written"
        return f"the last good checkpoint is kept in {self.checkpoint_path}"

"""Stopping a harness run at a step boundary on SIGINT (Ctrl-C) or SIGTERM (a scheduler's pre-emption).

Within :func:`stop_on_signals` the first SIGINT or SIGTERM is only recorded. The training loops ask
:func:`should_stop` before each step and end the run there by raising :class:`Interrupted` (after writing a
checkpoint when the run keeps them); the runner asks it before each job. A second signal of the same kind stops at
once. Data-parallel, the ranks must stop before the same step: they agree every ``interval`` steps (the loops' log
interval), with one small ``all_reduce`` there and none in between.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["Interrupted", "should_stop", "stop_on_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the signals received within stop_on_signals, in order


class Interrupted(BaseException):
    """A run stopped by a signal (a ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` around a job
    takes it for the job's failure).

    :param signum: the signal.
    :param where: where the run stopped (``"in digits/vi/seed 0 before step 37 of 80"``), or ``""`` if at once.
    :param checkpoint: the checkpoint written there, or ``None``.
    """

    def __init__(self, signum: int, where: str = "", checkpoint: Path | None = None) -> None:
        self.signum, self.where, self.checkpoint = signum, where, checkpoint
        super().__init__(f"stopped by {self.name}" + (f" {where}" if where else " at once"))

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """The shell's status of a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


def _record(signum: int, frame: object) -> None:
    if signum in _received:
        raise Interrupted(signum)
    _received.append(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM are recorded for :func:`should_stop` instead of ending the process (in the
    main thread only: elsewhere the block changes nothing); the previous handlers are restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _record) for signum in SIGNALS}
    _received.clear()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received.clear()


def should_stop(step: int = 0, interval: int = 1) -> int | None:
    """The signal to stop for before ``step``, or ``None``. In one process: any recorded signal. Data-parallel: only
    when ``step`` is a multiple of ``interval``, the largest signal any rank received (one ``all_reduce`` of one
    number; every rank must call it at the same steps)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return _received[0] if _received else None
    if step % interval:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([max(_received, default=0)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None

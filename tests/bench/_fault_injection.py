"""``python -m tests.bench._fault_injection FAULT K -- ARGS``: ``python -m pyro_flat ARGS`` with a fault injected.

* ``kill-step K``: SIGKILL itself when the harness's loops reach their K-th step in this process (no cleanup runs);
* ``kill-write K``: SIGKILL itself in the middle of its K-th ``torch.save`` (a checkpoint, draw or record file),
  after half of the file's bytes are written and flushed;
* ``hold-step K``: at the K-th step, create ``HOLD_FILE`` (an environment variable) and wait there until killed;
* ``sigint-step K`` / ``sigterm-step K``: send itself SIGINT / SIGTERM at the K-th step, then go on (the harness stops
  at the next step boundary);
* ``stall-step K``: rank 1 of a data-parallel run writes its process id to ``HOLD_FILE`` and stops itself (SIGSTOP)
  at the K-th step, as a hung rank would;
* ``none``: no fault.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import torch

from pyro_flat.bench import loop
from pyro_flat.bench.cli import main


def _at_step(k: int, action) -> None:
    original, count = loop.TrainingLoop.__iter__, [0]

    def steps(self):
        for item in original(self):
            count[0] += 1
            if count[0] == k:
                action()
            yield item

    loop.TrainingLoop.__iter__ = steps


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hold() -> None:
    Path(os.environ["HOLD_FILE"]).touch()
    while True:
        time.sleep(0.1)


def _kill_in_write(k: int) -> None:
    original, count = torch.save, [0]

    def save(obj, handle, *args, **kwargs):
        count[0] += 1
        if count[0] != k:
            return original(obj, handle, *args, **kwargs)
        buffer = io.BytesIO()
        original(obj, buffer, *args, **kwargs)
        handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        handle.flush()
        os.fsync(handle.fileno())
        _die()

    torch.save = save


def _stall() -> None:
    if os.environ.get("RANK") == "1":
        Path(os.environ["HOLD_FILE"]).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    fault, k, argv = sys.argv[1], int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1 :]
    if fault == "kill-step":
        _at_step(k, _die)
    elif fault in ("sigint-step", "sigterm-step"):
        signum = signal.SIGINT if fault == "sigint-step" else signal.SIGTERM
        _at_step(k, lambda: os.kill(os.getpid(), signum))
    elif fault == "stall-step":
        _at_step(k, _stall)
    elif fault == "hold-step":
        _at_step(k, _hold)
    elif fault == "kill-write":
        _kill_in_write(k)
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault!r}")
    sys.exit(main(argv))

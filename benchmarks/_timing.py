"""The one timing helper of the benchmark scripts: interleaved repeats, medians, the markdown table.

The machine is shared and noisy, so every variant is timed in every repeat, the order alternating between repeats,
and the median over repeats is reported. A *variant* is a callable taking one step, or an object with ``step()``
and optional ``enter()`` / ``exit()`` (called around each timed block, e.g. to swap Pyro's parameter store) and
``units_per_step`` (how many units, e.g. gradient steps, one ``step()`` makes; default 1). The clock is wall time
unless a script passes another (``time.process_time``: the CPU time of this process, which other jobs on the machine
do not inflate; meaningful with one torch thread).
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping

import pyro
import torch


def _call(variant: object, method: str) -> None:
    fn = getattr(variant, method, None)
    if fn is not None:
        fn()


def time_block(variant: object, steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds (of ``clock``) per unit of ``steps`` consecutive steps of ``variant``."""
    step = variant.step if hasattr(variant, "step") else variant
    _call(variant, "enter")
    start = clock()
    for _ in range(steps):
        step()
    elapsed = clock() - start
    _call(variant, "exit")
    return elapsed / (steps * getattr(variant, "units_per_step", 1))


def warm_up(variants: Mapping[str, object], steps: int) -> dict[str, float]:
    """Run ``steps`` untimed steps of every variant (capture and compilation included); the wall seconds each took."""
    seconds = {}
    for name, variant in variants.items():
        start = time.perf_counter()
        if steps:
            time_block(variant, steps)
        seconds[name] = time.perf_counter() - start
    return seconds


def interleaved_times(variants: Mapping[str, object], repeats: int, steps: int, *, warmup: int = 0,
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds (of ``clock``) per unit of every variant in every repeat (``steps`` steps per timed block), the order
    alternating between repeats; ``warmup`` untimed steps of each variant first."""
    warm_up(variants, warmup)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(time_block(variants[name], steps, clock))
    return times


def medians_ms(times: Mapping[str, list[float]]) -> dict[str, float]:
    """The median of every variant, in milliseconds."""
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def timing_rows(times: Mapping[str, list[float]], unit: str = "step") -> list[str]:
    """The markdown table ``variant | median | min | max`` (milliseconds per ``unit``)."""
    med = medians_ms(times)
    lines = [f"| variant | median (ms / {unit}) | min | max |", "|---|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {med[name]:.2f} | {min(t) * 1e3:.2f} | {max(t) * 1e3:.2f} |")
    return lines


def environment() -> str:
    """The software and machine the figures were measured on."""
    return (f"torch {torch.__version__}, pyro {pyro.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()}, shared 2-core machine, {torch.get_num_threads()} torch thread(s).")


def fresh_compile_cache() -> str:
    """Point TorchInductor at an empty on-disk cache, so that the first compilation of each graph is timed cold (an
    identical graph compiled again in the same run hits it); returns the directory."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]

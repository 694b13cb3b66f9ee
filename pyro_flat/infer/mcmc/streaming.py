r"""Streaming posterior draws out of ``MCMC``, so that a large network's samples need not sit in memory.

``pyro.infer.MCMC`` keeps every draw of every site (``num_samples`` copies of the weights). For a network, pass a
:class:`DrawHook` as ``hook_fn`` and run :class:`pyro.infer.mcmc.api.StreamingMCMC` (which keeps only running
statistics): every draw is handed, in constrained space, to a callback — a streaming Bayesian model average, a
SWAG-style moment collector, or :class:`DiskWriter`, which saves each draw to a file that :func:`load_draws` streams
back::

    bma = StreamingBMA()
    hook = DrawHook(lambda draw: bma.update(predict_logits(model, draw, x_test)))
    StreamingMCMC(kernel, num_samples=100, warmup_steps=500, hook_fn=hook).run(x_train, y_train, subsample_size=128)

    hook = DrawHook(DiskWriter("draws/"))                    # or keep them on disk
    StreamingMCMC(kernel, num_samples=100, warmup_steps=500, hook_fn=hook).run(x_train, y_train, subsample_size=128)
    report = evaluate(bma_predict(model, load_draws("draws/"), x_test), y_test)

Only post-warm-up calls are draws; with the stochastic-gradient kernels one call is one draw after thinning or at a
cyclical schedule's collection step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from torch import Tensor

__all__ = ["DrawHook", "DiskWriter", "load_draws"]


class DrawHook:
    """A ``hook_fn`` for ``MCMC``/``StreamingMCMC`` that passes every post-warm-up draw to ``callback``.

    :param callback: called as ``callback({site: value})`` with detached values in constrained space (the kernel's
        ``transforms`` inverted).
    :param sites: the sites to pass (default: all the kernel's parameters).
    :type sites: Sequence[str] or None
    """

    def __init__(self, callback: Callable[[dict[str, Tensor]], object], sites: Sequence[str] | None = None) -> None:
        if not callable(callback):
            raise ValueError(f"DrawHook: expected a callable callback, got {callback!r}")
        self.callback = callback
        self.sites = None if sites is None else list(sites)
        self.num_draws = 0

    def __call__(self, kernel: MCMCKernel, params: Mapping[str, Tensor], stage: str, i: int) -> None:
        if not stage.startswith("Sample"):
            return
        names = list(params) if self.sites is None else self.sites
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"DrawHook: sites {missing} are not among the kernel's parameters {sorted(params)}")
        transforms = getattr(kernel, "transforms", None) or {}
        draw = {}
        for name in names:
            value = params[name].detach()
            draw[name] = transforms[name].inv(value) if name in transforms else value
        self.callback(draw)
        self.num_draws += 1


class DiskWriter:
    """A :class:`DrawHook` callback that saves draw :math:`k` to ``folder/draw_{k:06d}.pt`` (``torch.save``).

    :param folder: the output folder (created if needed; existing draw files there raise a ``ValueError``).
    :type folder: str or Path
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if any(self.folder.glob("draw_*.pt")):
            raise ValueError(f"DiskWriter: {self.folder} already holds draw_*.pt files; use an empty folder")
        self.count = 0

    def __call__(self, draw: Mapping[str, Tensor]) -> None:
        torch.save(dict(draw), self.folder / f"draw_{self.count:06d}.pt")
        self.count += 1


def load_draws(folder: str | Path, map_location: str | torch.device | None = None) -> Iterator[dict[str, Tensor]]:
    """Stream the draws written by :class:`DiskWriter`, in order, one file at a time (e.g. into
    :func:`~pyro_flat.infer.bma_predict`).

    :param folder: the folder of ``draw_*.pt`` files.
    :type folder: str or Path
    :param map_location: passed to ``torch.load`` (e.g. ``"cpu"``).
    :raises ValueError: if the folder holds no draw file.
    """
    files = sorted(Path(folder).glob("draw_*.pt"))
    if not files:
        raise ValueError(f"load_draws: no draw_*.pt file in {folder}")
    for path in files:
        yield torch.load(path, map_location=map_location, weights_only=True)

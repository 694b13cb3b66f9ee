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

To keep every draw at the price of a copy, give the draws a :class:`DrawBuffer`: tensors allocated once, one row per
draw, in memory or in files mapped into memory (written out by the operating system as they fill), and run
``StreamingMCMC`` with Pyro's counting statistics so that nothing else is kept per draw::

    buffer = DrawBuffer(100)                                 # or DrawBuffer(100, directory="draws/")
    buffer.streaming_mcmc(kernel, num_samples=100, warmup_steps=500).run(x_train, y_train, subsample_size=128)
    samples = buffer.samples()                               # {site: [100, ...]}, as MCMC.get_samples() returns
    samples = DrawBuffer.open("draws/").samples()            # later, from the files

(:meth:`DrawBuffer.streaming_mcmc` is ``StreamingMCMC(kernel, ..., hook_fn=buffer, statistics=StatsOfDict(
default=CountStats), save_params=[])``: Pyro's driver then copies nothing per draw, and the buffer keeps the kernel's
``save_params``.)

Only post-warm-up calls are draws; with the stochastic-gradient kernels one call is one draw after thinning or at a
cyclical schedule's collection step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from pyro.infer.mcmc.api import StreamingMCMC
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.ops.streaming import CountStats, StatsOfDict
from torch import Tensor

from ..._validation import check_int
from .base import StochasticGradientKernel, _is_identity

__all__ = ["DrawBuffer", "DrawHook", "DiskWriter", "load_draws"]


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


class DrawBuffer:
    """Every draw of a chain in tensors allocated once: ``[num_draws, *shape]`` per site, filled row by row.

    Keeping a draw costs one copy into its row, whatever the number of draws: no list of tensors, no final
    ``torch.stack`` (``MCMC`` does both, and holds the draws twice at the end). With a ``directory`` the tensors are
    files mapped into memory (``torch.from_file``, one ``site_NNN.bin`` per site and ``draws.json`` describing them):
    the operating system writes the rows out as they fill, memory holds what it caches, and :meth:`open` maps them
    back (a checkpoint then holds only the count).

    Use it as ``hook_fn`` of ``pyro.infer.mcmc.api.StreamingMCMC`` (see the module docstring; with ``MCMC`` Pyro keeps
    its own copies as well), or call :meth:`add` from a loop of one's own (the harness's SG-MCMC methods do). Chains
    run one after the other fill consecutive rows; chains run in parallel processes cannot share it.

    :param int num_draws: the rows, >= 1 (``num_samples`` times the number of chains).
    :param sites: the sites to keep (default: every site of the first draw).
    :type sites: Sequence[str] or None
    :param directory: where the files go (created; ``None``: in memory).
    :type directory: str or Path or None
    :param device: where in-memory rows live (default: the first draw's device; files are on the CPU).
    """

    def __init__(self, num_draws: int, *, sites: Sequence[str] | None = None, directory: str | Path | None = None,
                 device: torch.device | str | None = None) -> None:
        self.num_draws = check_int(num_draws, "num_draws", owner="DrawBuffer")
        self.sites = None if sites is None else list(sites)
        self.directory = None if directory is None else Path(directory)
        self.device = None if device is None else torch.device(device)
        if self.directory is not None and self.device not in (None, torch.device("cpu")):
            raise ValueError(f"DrawBuffer: a directory's files are mapped on the CPU; got device={device!r}")
        self.count = 0
        self.buffers: dict[str, Tensor] | None = None
        self._meta: dict = {}
        self._default_sites: Callable[[], list[str] | None] | None = None  # the kernel's, read at the first draw

    def _allocate(self, layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        if self.directory is None:
            self.buffers = {name: torch.empty((self.num_draws, *shape), dtype=dtype, device=self.device or device)
                            for name, (shape, dtype) in layout.items()}
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        sites = [{"name": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                  "file": f"site_{i:03d}.bin"} for i, (name, (shape, dtype)) in enumerate(layout.items())]
        self._meta = {"num_draws": self.num_draws, "count": 0, "sites": sites}
        self.buffers = _map_files(self.directory, self._meta, shared=True)
        self._write_meta()

    def _write_meta(self) -> None:
        self._meta["count"] = self.count
        (self.directory / "draws.json").write_text(json.dumps(self._meta))

    @torch.no_grad()
    def add(self, draw: Mapping[str, Tensor]) -> None:
        """Copy ``draw`` (``{site: value}``, detached or not) into the next row.

        :raises ValueError: when the rows are full, or a site is missing or has another shape than the first draw's.
        """
        if self.count >= self.num_draws:
            raise ValueError(f"DrawBuffer: all {self.num_draws} rows are full; allocate more draws")
        if self.buffers is None:
            names = list(draw) if self.sites is None else self.sites
            missing = [n for n in names if n not in draw]
            if missing:
                raise ValueError(f"DrawBuffer: sites {missing} are not in the draw {sorted(draw)}")
            self._allocate({n: (tuple(draw[n].shape), draw[n].dtype) for n in names}, draw[names[0]].device)
        row = self.count
        for name, buffer in self.buffers.items():
            value = draw[name]
            if value.shape != buffer.shape[1:]:
                raise ValueError(f"DrawBuffer: site {name!r} has shape {tuple(value.shape)}, the first draw's "
                                 f"{tuple(buffer.shape[1:])}")
            buffer[row].copy_(value)
        self.count = row + 1

    def __call__(self, kernel: MCMCKernel, params: Mapping[str, Tensor], stage: str, i: int) -> None:
        """``MCMC``'s ``hook_fn``: every post-warm-up call's parameters, in constrained space (the kernel's
        ``transforms`` inverted), go into the next row."""
        if not stage.startswith("Sample"):
            return
        if self.sites is None and self._default_sites is not None:
            self.sites = self._default_sites()
        transforms = getattr(kernel, "transforms", None) or {}
        names = params if self.sites is None else self.sites
        draw = {}
        for name in names:
            if name not in params:
                raise ValueError(f"DrawBuffer: site {name!r} is not among the kernel's parameters {sorted(params)}")
            transform = transforms.get(name)
            value = params[name]
            draw[name] = value if transform is None or _is_identity(transform) else transform.inv(value.detach())
        self.add(draw)

    def streaming_mcmc(self, kernel: MCMCKernel, num_samples: int, warmup_steps: int | None = None,
                       **options: object) -> StreamingMCMC:
        """Pyro's ``StreamingMCMC`` that keeps its draws here and nothing else: this buffer as ``hook_fn``, Pyro's
        counting statistics, and ``save_params=[]`` so that Pyro's driver does not concatenate each draw into a flat
        vector (a copy of every weight). The buffer keeps the sites the kernel would have kept (its ``save_params``,
        read first; as ``MCMC(save_params=...)`` does, the kernel's are then set).

        :param kernel: the MCMC kernel.
        :param int num_samples: the draws (at most the buffer's rows).
        :param warmup_steps: as for ``StreamingMCMC``.
        :param options: ``StreamingMCMC``'s other options (``num_chains``, ``disable_progbar``, ...).
        """
        if any(k in options for k in ("hook_fn", "statistics", "save_params")):
            raise ValueError("DrawBuffer.streaming_mcmc sets hook_fn, statistics and save_params itself")
        if self.sites is None:
            sites = getattr(kernel, "save_params", None)
            if sites:
                self.sites = list(sites)
            elif isinstance(kernel, StochasticGradientKernel):  # its default is known after setup
                self._default_sites = kernel._default_save_params
        return StreamingMCMC(kernel, num_samples, warmup_steps, hook_fn=self,
                             statistics=StatsOfDict(default=CountStats), save_params=[], **options)

    def samples(self) -> dict[str, Tensor]:
        """The draws so far, ``{site: [count, *shape]}`` (views of the rows, no copy)."""
        if self.buffers is None:
            raise ValueError("DrawBuffer: no draw yet")
        return {name: buffer[: self.count] for name, buffer in self.buffers.items()}

    def flush(self) -> None:
        """Record the count in ``draws.json`` (with a directory), so that :meth:`open` sees every row written."""
        if self.directory is not None and self.buffers is not None:
            self._write_meta()

    def state_dict(self) -> dict:
        """The count, and in memory the rows so far (copies): a checkpoint. With a directory the rows are in the
        files (the count is flushed to ``draws.json``)."""
        self.flush()
        if self.directory is not None or self.buffers is None:
            return {"count": self.count}
        return {"count": self.count, "draws": {name: b[: self.count].clone() for name, b in self.buffers.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a :meth:`state_dict` (with a directory: map its files and keep their first ``count`` rows)."""
        count = int(state["count"])
        if count > self.num_draws:
            raise ValueError(f"DrawBuffer: the state holds {count} draws, more than the {self.num_draws} rows")
        if "draws" in state:
            draws = state["draws"]
            device = next(iter(draws.values())).device
            self._allocate({n: (tuple(v.shape[1:]), v.dtype) for n, v in draws.items()}, device)
            for name, value in draws.items():
                self.buffers[name][:count].copy_(value)
        elif self.directory is not None and (self.directory / "draws.json").exists():
            meta = json.loads((self.directory / "draws.json").read_text())
            if meta["num_draws"] != self.num_draws:
                raise ValueError(f"DrawBuffer: {self.directory} holds {meta['num_draws']} rows, not {self.num_draws}")
            self._meta, self.buffers = meta, _map_files(self.directory, meta, shared=True)
        elif count:
            raise ValueError(f"DrawBuffer: the state counts {count} draws but {self.directory} holds no draws.json")
        self.count = count

    @classmethod
    def open(cls, directory: str | Path) -> DrawBuffer:
        """The draws a :class:`DrawBuffer` wrote to ``directory`` (mapped copy-on-write: changes stay in memory),
        up to the count last flushed.

        :raises ValueError: if the folder holds no ``draws.json``.
        """
        directory = Path(directory)
        if not (directory / "draws.json").exists():
            raise ValueError(f"DrawBuffer.open: no draws.json in {directory}")
        meta = json.loads((directory / "draws.json").read_text())
        buffer = cls(meta["num_draws"], directory=directory)
        buffer._meta, buffer.buffers = meta, _map_files(directory, meta, shared=False)
        buffer.count = meta["count"]
        return buffer


def _preallocate(path: Path, num_bytes: int) -> None:
    """Give the file ``path`` (created if missing) ``num_bytes`` bytes of disk now (``posix_fallocate``, or zeros
    written where it is missing), so that a full disk is an ``OSError`` here: a memory-mapped file left sparse gets
    its blocks only when a row is written, and a full disk then kills the process with SIGBUS."""
    with open(path, "ab") as handle:
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(handle.fileno(), 0, num_bytes)
            else:
                handle.write(bytes(max(0, num_bytes - handle.tell())))
                handle.flush()
        except OSError as error:
            raise OSError(error.errno, os.strerror(error.errno), str(path)) from error


def _map_files(directory: Path, meta: Mapping, *, shared: bool) -> dict[str, Tensor]:
    """The site tensors of ``draws.json``'s description, mapped from their files (created and given their disk
    space when ``shared``: :func:`_preallocate`)."""
    buffers = {}
    for site in meta["sites"]:
        shape = (meta["num_draws"], *site["shape"])
        size = 1
        for n in shape:
            size *= n
        dtype = getattr(torch, site["dtype"])
        if shared:
            _preallocate(directory / site["file"], size * dtype.itemsize)
        flat = torch.from_file(str(directory / site["file"]), shared=shared, size=size, dtype=dtype)
        buffers[site["name"]] = flat.view(shape)
    return buffers

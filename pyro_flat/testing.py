r"""Test utilities for device-agnostic code: count the host synchronisations of a block of code on a CPU-only machine.

A *host synchronisation* makes the Python thread wait until the accelerator has finished its queued work, which
stalls a GPU pipeline when it happens at every step. ``torch.cuda.set_sync_debug_mode("error")`` detects them, but
only when a GPU is present. :class:`HostSyncCounter` detects the same calls on any device, including the CPU, so a
CPU-only CI can assert that a training step adds none:

* a tensor read as a Python number: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``if t:``, ``f"{t:.3f}"``,
  ``math.isfinite(t)``; all of these dispatch ``aten._local_scalar_dense``;
* an explicit copy to the host: ``.cpu()``, ``.tolist()``, ``.numpy()``, ``.to("cpu")`` (on a CPU tensor these are
  no-ops that the dispatcher never sees, so they are counted by name at the Python API), and ``.to(device)`` from
  a non-CPU tensor (e.g. on the ``meta`` device) to the CPU;
* operations whose output shape depends on the data, which CUDA must synchronise to allocate the output:
  ``nonzero``, boolean-mask indexing ``t[mask]``, ``masked_select``, ``unique``;
* linear algebra that reads its solver's status on the host on CUDA: ``torch.linalg.cholesky``, ``inv``, ``solve``
  (their error check, ``aten._linalg_check_errors``), the ``*_ex`` forms with ``check_errors=True``,
  ``torch.linalg.eigh``, ``torch.cholesky_inverse``, and ``torch.cholesky_solve`` of a batch (MAGMA). The ``*_ex``
  forms (``torch.linalg.cholesky_ex``, status kept on the device) and ``torch.linalg.solve_triangular`` are not;
* a copy from the host to a tensor's device that is not the CPU (``x.to(device)``, ``t.copy_(host_tensor)``, an
  index held on the host, ``t[host_index]``): a blocking copy from pageable host memory on an accelerator; seen when
  the code runs on a non-CPU device, e.g. ``meta`` (on the CPU there is no such copy to see);
* a tensor made from Python data for a tensor's device: ``torch.tensor(0.3, device=x.device)``,
  ``torch.as_tensor(...)``, ``torch.scalar_tensor(...)`` with ``device=`` a ``torch.device`` or an accelerator (e.g.
  ``dist.Normal(loc, 0.3)``, which makes its scale so): on an accelerator a blocking copy from host memory, which
  waits like a read. Counted whatever the device, so that a CPU run sees what a GPU run would; a literal
  ``device="cpu"`` (a tensor meant for the host, as torch's optimisers make for their step counters) is not.

Not counted: torch's optimizers (``Adam``, ...) read their step counter with ``.item()``, but keep it on the host
unless ``capturable=True``, so the read is free on a GPU.

Example::

    with HostSyncCounter() as syncs:
        for _ in range(5):
            optimizer.step(closure)
    assert syncs.count == 0, syncs.report()

Why a module of the package (not a test helper): users who write their own objective, kernel or training loop on
top of pyro_flat need the same check in their CPU-only CI, and it depends on torch only.

.. note:: On a CPU-only machine every tensor is on the host, so the counter cannot tell a scalar read of a tensor
    that lives on the host by design (``torch.optim.Adam``'s ``step`` counter, free on a GPU) from one of a device
    tensor: compare against a baseline that makes the same reads (e.g. ``Trace_ELBO`` and ``Adam``).

.. note:: The counter sees what runs in the current thread through the torch dispatcher and ``Tensor`` methods. It
    does not see ``torch.cuda.synchronize()``, host copies made by C++ extensions, or the synchronisation implied
    by printing a CUDA tensor's data without formatting it through Python.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._internals import TorchDispatchMode
from ._validation import check_int

__all__ = ["HostSync", "HostSyncCounter"]

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_DATA_DEPENDENT_SHAPE = {
    torch.ops.aten.nonzero.default: "nonzero",
    torch.ops.aten.masked_select.default: "masked_select",
    torch.ops.aten._unique2.default: "unique",
    torch.ops.aten.unique_dim.default: "unique",
    torch.ops.aten.unique_consecutive.default: "unique_consecutive",
}
_STATUS_READ = {  # linear algebra whose CUDA kernels read the solver's status on the host
    torch.ops.aten._linalg_check_errors.default: "linalg error check",
    torch.ops.aten._linalg_eigh.default: "eigh",
    torch.ops.aten.cholesky_inverse.default: "cholesky_inverse",
}
_STATUS_READ_IF_CHECKED = {  # the *_ex forms, with check_errors=True
    torch.ops.aten.linalg_cholesky_ex.default, torch.ops.aten.linalg_inv_ex.default,
    torch.ops.aten._linalg_solve_ex.default, torch.ops.aten.linalg_lu_factor_ex.default,
    torch.ops.aten.linalg_ldl_factor_ex.default,
}
_HOST_COPY_METHODS = {"cpu", "tolist", "numpy"}
_FROM_PYTHON_DATA = {torch.tensor, torch.as_tensor, torch.scalar_tensor}


@dataclass(frozen=True)
class HostSync:
    """One host synchronisation: what caused it and where (the innermost frames outside torch).

    :param str kind: ``"scalar read"``, ``"host copy (.name)"``, ``"data-dependent shape (op)"``, ``"solver status
        read (op)"`` or ``"host-to-device copy (...)"``.
    :param str where: ``file:line in function`` of the innermost frames of the caller's code.
    """

    kind: str
    where: str


def _caller(depth: int) -> str:
    frames = [
        f for f in traceback.extract_stack()[:-2]
        if "/torch/" not in f.filename and not f.filename.endswith("/pyro_flat/testing.py")
    ]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} in {f.name}" for f in reversed(frames[-depth:]))


def _reads_an_optimizer_step_counter() -> bool:
    """Whether the scalar being read is a torch optimizer's host-resident step counter (``_get_value``)."""
    return any(
        f.name == "_get_value" and f.filename.endswith(("torch/optim/optimizer.py", "torch\\optim\\optimizer.py"))
        for f in traceback.extract_stack(limit=12)
    )


def _for_a_tensors_device(device: object) -> bool:
    """Whether a factory's ``device=`` is an accelerator or a ``torch.device`` (taken from a tensor, e.g.
    ``x.device``: an accelerator when the code runs on one); a literal ``"cpu"`` places the tensor on the host."""
    if isinstance(device, torch.device):
        return True
    return isinstance(device, (str, int)) and str(device).split(":")[0] != "cpu"


def _on_host(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"


def _copies_from_host(func: Any, args: tuple, kwargs: dict) -> bool:  # noqa: ANN401
    """Whether an operation copies a host tensor to another device: ``_to_copy`` to a non-CPU device, ``copy_`` into
    a non-CPU tensor, or indexing a non-CPU tensor with host indices."""
    if func is torch.ops.aten._to_copy.default:
        target = kwargs.get("device")
        return _on_host(args[0]) and target is not None and torch.device(target).type != "cpu"
    if func is torch.ops.aten.copy_.default:
        return not _on_host(args[0]) and _on_host(args[1])
    if func is torch.ops.aten.index.Tensor:
        return not _on_host(args[0]) and any(_on_host(i) for i in args[1])
    return False


def _copies_to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(...)`` moves a tensor off an accelerator to the host, or names the host literally
    (``.to("cpu")``: a hard-coded host device, a copy on any accelerator). ``.to(device=other.device)`` is not."""
    targets = [a for a in args[1:] if isinstance(a, (str, torch.device))] + [kwargs.get("device")]
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    for target in targets:
        if isinstance(target, str) and target.split(":")[0] == "cpu":
            return True
        if isinstance(target, torch.device) and target.type == "cpu" and source is not None:
            if source.device.type != "cpu":
                return True
    return False


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:  # noqa: ANN401
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_COPY_METHODS or (name == "to" and _copies_to_host(args, kwargs)):
            self.owner._add(f"host copy (.{name})")
        elif func in _FROM_PYTHON_DATA and _for_a_tensors_device(kwargs.get("device")) and args and not isinstance(
            args[0], torch.Tensor
        ):
            self.owner._add(f"host-to-device copy (torch.{name} from Python data)")
        return func(*args, **kwargs)


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:  # noqa: ANN401
        kwargs = kwargs or {}
        if func is _SCALAR_READ:
            if not _reads_an_optimizer_step_counter():
                self.owner._add("scalar read")
        elif func in _DATA_DEPENDENT_SHAPE:
            self.owner._add(f"data-dependent shape ({_DATA_DEPENDENT_SHAPE[func]})")
        elif func in _STATUS_READ:
            self.owner._add(f"solver status read ({_STATUS_READ[func]})")
        elif func in _STATUS_READ_IF_CHECKED and kwargs.get("check_errors", False):
            self.owner._add(f"solver status read ({func.__name__.split('.')[0]}, check_errors=True)")
        elif func is torch.ops.aten.cholesky_solve.default and args[0].dim() > 2 and args[0].shape[:-2].numel() > 1:
            self.owner._add("solver status read (cholesky_solve of a batch)")
        elif _copies_from_host(func, args, kwargs):
            self.owner._add(f"host-to-device copy ({func.__name__.split('.')[0]})")
        elif func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            self.owner._add("data-dependent shape (boolean-mask index)")
        return func(*args, **kwargs)


class HostSyncCounter:
    r"""A context manager that records every host synchronisation made inside it (see the module docstring).

    :param int depth: how many caller frames (outside torch) to keep per synchronisation in :attr:`syncs`
        (default 3); ``0`` keeps none and is faster.
    :raises ValueError: for a negative ``depth``.

    Attributes: :attr:`syncs` (a list of :class:`HostSync`), :attr:`count`; :meth:`report` formats them.
    Counters can be re-entered; each ``with`` block appends to the same list, and :meth:`reset` clears it.
    """

    def __init__(self, depth: int = 3) -> None:
        check_int(depth, "depth", minimum=0, owner="HostSyncCounter")
        self.depth = depth
        self.syncs: list[HostSync] = []
        self._modes: list[tuple[_FunctionLevel, _DispatchLevel]] = []

    @property
    def count(self) -> int:
        """The number of host synchronisations recorded."""
        return len(self.syncs)

    def reset(self) -> None:
        """Forget the recorded synchronisations."""
        self.syncs.clear()

    def report(self) -> str:
        """A summary: each distinct (kind, place) with its number of occurrences."""
        counts = Counter(self.syncs)
        lines = [f"{n} x {s.kind} at {s.where}" for s, n in counts.most_common()]
        return f"{self.count} host synchronisation(s)" + ("".join(f"\n  {line}" for line in lines))

    def _add(self, kind: str) -> None:
        self.syncs.append(HostSync(kind, _caller(self.depth) if self.depth else ""))

    def __enter__(self) -> HostSyncCounter:
        modes = (_FunctionLevel(self), _DispatchLevel(self))
        modes[0].__enter__()
        modes[1].__enter__()
        self._modes.append(modes)
        return self

    def __exit__(self, *exc: object) -> None:
        function_level, dispatch_level = self._modes.pop()
        dispatch_level.__exit__(*exc)
        function_level.__exit__(*exc)

"""The captures of one object (a compiled objective or kernel): :class:`CompiledCalls` runs each kind of step eagerly
once, captures it (:func:`~pyro_flat.runtime.capture.capture`) and evaluates the capture after that, compiled or not;
:func:`tensor_key`, :func:`options_key` and :func:`module_key` make the keys a capture is valid for."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from .._internals import pytree
from .capture import CapturedFunction, CaptureError, CompilationFallbackWarning, capture
from .rng import cuda_devices, set_torch_random_state, torch_random_state

__all__ = ["CompiledCalls", "module_key", "options_key", "tensor_key"]


def tensor_key(tree: Any) -> tuple[list[Tensor], Hashable]:
    """Split a pytree (a program's arguments) into its tensors and a hashable key of everything else: the tree's
    structure, the tensors' shapes, dtypes, devices and whether they require gradients, and the other leaves (by
    value when hashable, else by identity)."""
    leaves, spec = pytree.tree_flatten(tree)
    tensors, key = [], [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            tensors.append(leaf)
            key.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                key.append(("value", type(leaf), leaf))
            except TypeError:
                key.append(("object", id(leaf)))
    return tensors, tuple(key)


def options_key(obj: object) -> Hashable:
    """The public scalar options of ``obj`` as they are now (an objective's ``rho``, ``radius``, ``kl_weight``; a
    kernel's ``eta``, ``temperature``, ...): a capture bakes them into its graph, so a change must capture again."""
    scalars = (bool, int, float, str, type(None))
    return tuple(sorted((k, v) for k, v in vars(obj).items() if not k.startswith("_") and isinstance(v, scalars)))


def module_key(*objects: object) -> Hashable:
    """The state of the ``nn.Module`` s among ``objects`` that a capture depends on: their submodules' train/eval
    modes and the identity of their buffers (replaced by ``.to()``)."""
    key = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            key.append(tuple(m.training for m in obj.modules()))
            key.append(tuple(id(b) for b in obj.buffers()))
    return tuple(key)


_FIRST = object()


class CompiledCalls:
    """The captures of one object (a compiled objective or kernel), by key: a key's first call runs eagerly (guides
    set themselves up, parameters are created), its second call is the eager step captured by :func:`capture`, later
    calls evaluate the captured function, compiled with ``torch.compile(**jit_options)`` unless
    ``jit_options["backend"]`` is ``None``. A step that cannot be captured (or compiled) runs eagerly for that key,
    after one :class:`CompilationFallbackWarning` per object.

    :param str owner: the object's name, for the warning.
    :param jit_options: options of :func:`torch.compile` (``backend``, ``mode``, ``options``, ...); ``backend=None``
        evaluates the captured graph without compiling it.
    """

    def __init__(self, owner: str, jit_options: Mapping[str, Any] | None = None) -> None:
        options = dict(jit_options or {})
        if "backend" in options and options["backend"] is None:
            options = None
        self.owner = owner
        self.options = options
        self.entries: dict[Hashable, Any] = {}
        self.warned = False

    def __getstate__(self) -> dict:  # captured graphs and compiled code stay with the process that made them
        return {**self.__dict__, "entries": {}}

    def clear(self) -> None:
        self.entries.clear()

    def fallback(self, reason: str, eager: bool = True) -> None:
        """Warn, once per object, that the compiled path is not used (``eager``) or not compiled."""
        if not self.warned:
            self.warned = True
            what = "runs its eager path (same results, no speed-up)" if eager else "is not compiled"
            warnings.warn(f"{self.owner} {what}: {reason}", CompilationFallbackWarning, stacklevel=4)

    def mode(self, key: Hashable) -> str:
        """What the next call with ``key`` does: ``"first"`` (runs eagerly), ``"capture"`` (runs eagerly and
        captures), ``"captured"`` (runs the captured function) or ``"eager"`` (cannot be captured: runs eagerly)."""
        entry = self.entries.get(key)
        if entry is None:
            return "first"
        if entry is _FIRST:
            return "capture"
        return "eager" if isinstance(entry, CaptureError) else "captured"

    def __call__(self, key: Hashable, fn: Callable[[], Any], inputs: Callable[[], Sequence[Tensor]]) -> Any:
        """Evaluate the step ``fn`` (eagerly, captured, or from its capture) for ``key``.

        :param inputs: returns the step's input tensors now (called at capture and at every compiled evaluation).
        """
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = _FIRST
            return fn()
        if entry is _FIRST:
            outputs, captured = capture(fn, inputs)
            if isinstance(captured, CaptureError):
                self.entries[key] = captured
                self.fallback(str(captured))
            else:
                if self.options is not None:
                    captured.compile(self.options)
                self.entries[key] = captured
            return outputs
        if isinstance(entry, CaptureError):
            return fn()
        if not entry.compiling:
            return entry(inputs())
        devices = cuda_devices()
        state = torch_random_state(devices)  # the failed attempt may have drawn the step's random numbers already
        try:
            return entry(inputs())
        except Exception as error:  # noqa: BLE001 (torch.compile failed; the captured graph is still exact)
            entry.uncompile()
            self.fallback(f"torch.compile failed; the captured graph runs uncompiled. The error:\n{_whole(error)}",
                          eager=False)
            set_torch_random_state(state, devices)
            return entry(inputs())

    def captures(self) -> list[CapturedFunction]:
        """The captured functions so far (for their timings)."""
        return [e for e in self.entries.values() if isinstance(e, CapturedFunction)]


def _whole(error: BaseException) -> str:
    """The whole error: every line of its message and of the errors it was raised from (torch.compile's first line,
    ``BackendCompilerFailed: backend='inductor' raised:``, says nothing by itself), with the innermost traceback."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-3)).rstrip()

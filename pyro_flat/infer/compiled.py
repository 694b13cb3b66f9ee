"""Compiled evaluation of Pyro programs: :mod:`pyro_flat.runtime.capture` (the capture) and
:mod:`pyro_flat.runtime.compiled_calls` (the per-object cache) in the runtime layer, importable from here too."""

from ..runtime.capture import CapturedFunction, CaptureError, CompilationFallbackWarning, capture, is_capturing
from ..runtime.compiled_calls import CompiledCalls, module_key, options_key, tensor_key

__all__ = ["CaptureError", "CapturedFunction", "CompilationFallbackWarning", "CompiledCalls", "capture",
           "is_capturing", "module_key", "options_key", "tensor_key"]

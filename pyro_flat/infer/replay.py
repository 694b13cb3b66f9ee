"""Record and replay a run: :mod:`pyro_flat.runtime.replay` (the runtime layer), importable from here too."""

from ..runtime.batchnorm import batchnorm_statistics_frozen
from ..runtime.replay import RecordedSite, RunRecorder, substituted_tensors

__all__ = ["RecordedSite", "RunRecorder", "batchnorm_statistics_frozen", "substituted_tensors"]

r"""Closure-based optimizers for flat posteriors: :class:`SAM` and :class:`BayesianSAM`.

Both need a *global* quantity (SAM: the norm of the whole gradient) and a *second* gradient evaluation at a
perturbed point, so they are :class:`torch.optim.Optimizer` subclasses driven by a closure, not per-tensor
:class:`pyro.optim.PyroOptim` factories (which build one optimizer per tensor and pass no closure). Use them on the
parameters of a torch network, or of a Pyro guide (``AutoDelta`` for MAP-type training) with a closure that
evaluates a Pyro loss on one fixed minibatch; see each class for the Pyro-facing form.
"""

from .bayesian_sam import BayesianSAM
from .sam import SAM

__all__ = ["SAM", "BayesianSAM"]

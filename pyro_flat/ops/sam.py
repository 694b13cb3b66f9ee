r"""The sharpness-aware minimisation (SAM) ascent step.

For a loss :math:`L(\theta)` with gradient :math:`g=\nabla_\theta L(\theta)` the first-order worst case inside the
Euclidean ball :math:`\{\theta' : \|\theta'-\theta\|_2\le\rho\}` is

.. math:: \hat\epsilon(\theta) = \rho\, \frac{g}{\|g\|_2},

where :math:`\|\cdot\|_2` is the *global* norm over all parameter tensors together [1]. The adaptive variant (ASAM,
[2]) rescales elementwise by :math:`T_\theta=|\theta|`:

.. math:: \hat\epsilon(\theta) = \rho\, \frac{T_\theta^2\, g}{\|T_\theta\, g\|_2}.

References:
    * [1] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
      Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
    * [2] `ASAM: Adaptive Sharpness-Aware Minimization for Scale-Invariant Learning of Deep Neural Networks`,
      Jungmin Kwon, Jeongseop Kim, Hyunseo Park, In Kwon Choi (ICML 2021), arXiv:2102.11600
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .._validation import check_real
from .tree import global_norm


def sam_perturbation(
    grads: Sequence[Tensor],
    rho: float | Tensor,
    *,
    adaptive: bool = False,
    params: Sequence[Tensor] | None = None,
    eps: float = 1e-12,
) -> list[Tensor]:
    r"""The SAM ascent perturbation :math:`\hat\epsilon` for each tensor of ``grads``.

    :param grads: gradients :math:`g_i` of the loss, one per parameter tensor.
    :param rho: radius :math:`\rho\ge 0` of the ball.
    :param adaptive: use the ASAM scaling :math:`T_\theta = |\theta|` (needs ``params``).
    :param params: the parameter tensors :math:`\theta_i` (only for ``adaptive=True``).
    :param eps: added to the norm so a zero gradient gives a zero perturbation, not NaN.
    :returns: the perturbations, shaped like ``grads``; detached from the graph.
    """
    grads = [g.detach() for g in grads]
    if adaptive:
        if params is None or len(params) != len(grads):
            raise ValueError("sam_perturbation: adaptive=True needs `params`, one tensor per gradient")
        scales = [p.detach().abs() for p in params]
        norm = global_norm([s * g for s, g in zip(scales, grads, strict=True)])
        return [rho * s.square() * g / (norm + eps) for s, g in zip(scales, grads, strict=True)]
    norm = global_norm(grads)
    return [rho * g / (norm + eps) for g in grads]


def check_radius(rho: float, name: str = "rho") -> float:
    """Validate a SAM-type radius: a finite, non-negative number. Returns it as a float."""
    return check_real(rho, name, low=0)


__all__ = ["sam_perturbation", "check_radius"]

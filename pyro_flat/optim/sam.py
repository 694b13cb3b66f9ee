r"""Sharpness-aware minimisation (SAM) as a closure-based :class:`torch.optim.Optimizer` that wraps a base optimizer.

SAM [1] minimises :math:`\max_{\|\epsilon\|_2\le\rho} L(\theta+\epsilon)` with one ascent step: at the parameters
:math:`\theta` it computes the gradient :math:`g=\nabla L_{\mathcal B}(\theta)` of the minibatch loss, moves to the
first-order worst case :math:`\theta+\hat\epsilon` with

.. math:: \hat\epsilon = \rho\,\frac{g}{\|g\|_2}\qquad\Big(\text{ASAM [2]: }\ \hat\epsilon=\rho\,
    \frac{|\theta|^2\odot g}{\|\,|\theta|\odot g\,\|_2}\Big),

takes the gradient there, :math:`g_{\mathrm{SAM}}=\nabla L_{\mathcal B}(\theta+\hat\epsilon)`, returns to
:math:`\theta` and lets the base optimizer (SGD, Adam, ...) step with :math:`g_{\mathrm{SAM}}`. The norm is the
*global* L2 norm over every parameter of every group (:func:`pyro_flat.ops.sam.sam_perturbation`), and
:math:`\hat\epsilon` is a constant (no gradient flows through it).

**m-sharpness** [1]. Passing a *sequence* of :math:`M` closures, one per disjoint sub-batch of the minibatch, gives
every sub-batch its own perturbation :math:`\hat\epsilon_j` (from its own gradient) and averages the second-pass
gradients, :math:`g_{\mathrm{SAM}}=\frac1M\sum_j\nabla L_j(\theta+\hat\epsilon_j)`, as ``build_sam_optimizer`` in
github.com/team-approx-bayes/bayesian-sam does (``batchsplit`` 8 there).

Why a closure and not a :class:`pyro.optim.PyroOptim`: SAM needs a global norm and a second gradient evaluation at
the perturbed point, which a per-tensor Pyro optimizer cannot do. With a Pyro model, build the closure from a Pyro
loss over a **fixed** minibatch (both passes must score the same data), e.g. with ``AutoDelta`` (MAP; the prior acts
as weight decay)::

    guide = AutoDelta(model); guide(x[:1], y[:1])               # create the parameters
    opt = SAM(guide.parameters(), torch.optim.Adam, rho=0.05, lr=1e-3)
    elbo = Trace_ELBO()
    idx = torch.randperm(N)[:B]                                  # one minibatch for both passes
    opt.step(lambda: (elbo.differentiable_loss(model, guide, x[idx], y[idx], num_data=N) / N).backward())

The closure runs twice per step; the second evaluation replays the first (:mod:`pyro_flat.infer.replay`): the same
random numbers (dropout masks, indices drawn with torch's generator), the same subsample indices of any ``pyro.plate``
it runs, and BatchNorm running statistics left unchanged by the perturbed pass (the F-BNN code's
``disable_running_stats``).

References:
    * [1] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
      Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
    * [2] `ASAM: Adaptive Sharpness-Aware Minimization for Scale-Invariant Learning of Deep Neural Networks`,
      Jungmin Kwon, Jeongseop Kim, Hyunseo Park, In Kwon Choi (ICML 2021), arXiv:2102.11600
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..ops.sam import check_radius, sam_perturbation
from ._common import Closure, as_closures, mean_loss, recorded_gradients_at, replayed_gradients_at


class SAM(Optimizer):
    r"""SAM around a base :class:`torch.optim.Optimizer`: two gradient evaluations per step, global-norm ascent.

    :param params: the parameters (an iterable of tensors or of parameter-group dicts).
    :param base_optimizer: the base optimizer *class* (or any factory ``base_optimizer(param_groups, **kwargs)``),
        e.g. ``torch.optim.SGD``; it shares this optimizer's ``param_groups``, so learning-rate schedulers can act
        on either.
    :param float rho: the radius :math:`\rho\ge0`; default 0.05 (the SAM paper's CIFAR value [1]).
        ``rho=0`` gives the base optimizer at twice the cost.
    :param bool adaptive: use ASAM's elementwise scaling :math:`|\theta|` [2]; default ``False``.
    :param base_kwargs: arguments of the base optimizer (``lr``, ``momentum``, ``weight_decay``, ...).

    ``step(closure)`` takes a closure that zeroes nothing itself (the optimizer sets ``.grad`` to ``None`` before
    every call), evaluates the mean minibatch loss, calls ``backward()`` and returns the loss; or a sequence of
    such closures, one per sub-batch (m-sharpness). It returns the mean of the closures' losses at the
    unperturbed :math:`\theta` (a detached tensor, no host sync). On return ``p.grad`` holds
    :math:`g_{\mathrm{SAM}}`.

    ``state_dict()`` holds the base optimizer's state as well (key ``"base_optimizer"``).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        base_optimizer: Callable[..., Optimizer],
        rho: float = 0.05,
        adaptive: bool = False,
        **base_kwargs: Any,
    ) -> None:
        if not callable(base_optimizer):
            raise ValueError(f"SAM: `base_optimizer` must be an optimizer class or factory, got {base_optimizer!r}")
        if not isinstance(adaptive, bool):
            raise ValueError(f"SAM: `adaptive` must be a bool, got {adaptive!r}")
        self.rho = check_radius(rho)
        self.adaptive = adaptive
        super().__init__(params, dict(base_kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        if not isinstance(self.base_optimizer, Optimizer):
            raise ValueError(f"SAM: `base_optimizer` must build a torch.optim.Optimizer, got {self.base_optimizer!r}")
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def perturbation(self, grads: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
        r""":math:`\hat\epsilon` for the gradients ``grads`` at ``params`` (global norm over all of them)."""
        return sam_perturbation(grads, self.rho, adaptive=self.adaptive, params=params)

    @torch.no_grad()
    def step(self, closure: Closure | Sequence[Closure] | None = None) -> Tensor | None:  # type: ignore[override]
        """One SAM step; see the class docstring for the closure protocol."""
        closures = as_closures("SAM", closure)
        params = self._params()
        origin = [p.detach().clone() for p in params]
        losses, grad_sum = [], None
        for c in closures:
            loss, grads, run = recorded_gradients_at(c, params)
            losses.append(loss)
            eps = self.perturbation(grads, origin)
            torch._foreach_add_(params, eps)
            grads = replayed_gradients_at(c, params, run)
            torch._foreach_copy_(params, origin)
            if grad_sum is None:
                grad_sum = [g.clone() for g in grads] if len(closures) > 1 else grads
            else:
                torch._foreach_add_(grad_sum, grads)
        if len(closures) > 1:
            torch._foreach_div_(grad_sum, float(len(closures)))
        for p, g in zip(params, grad_sum, strict=True):
            p.grad = g
        self.base_optimizer.step()
        return mean_loss(losses)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["base_optimizer"] = self.base_optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        base = state_dict.pop("base_optimizer", None)
        if base is None:
            raise ValueError("SAM.load_state_dict: the state has no 'base_optimizer' entry (not saved by SAM?)")
        self.base_optimizer.load_state_dict(base)
        super().load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups


__all__ = ["SAM"]

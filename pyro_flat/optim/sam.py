r"""Sharpness-aware minimisation (SAM) as a closure-based :class:`torch.optim.Optimizer` that wraps a base optimizer.

SAM [1] minimises :math:`\max_{\|\epsilon\|_2\le\rho} L(\theta+\epsilon)` with one ascent step: the base optimizer
(SGD, Adam, ...) steps with

.. math:: g_{\mathrm{SAM}}=\nabla L_{\mathcal B}(\theta+\hat\epsilon),\qquad \hat\epsilon = \rho\,\frac{g}{\|g\|_2},
    \quad g=\nabla L_{\mathcal B}(\theta),

:math:`L_{\mathcal B}` the minibatch loss, the norm global over every parameter of every group and
:math:`\hat\epsilon` a constant (:func:`pyro_flat.ops.sam.sam_perturbation`, with ASAM [2]'s elementwise scaling when
``adaptive``). **m-sharpness** [1]: a *sequence* of :math:`M` closures, one per disjoint sub-batch, gives each its own
:math:`\hat\epsilon_j` and :math:`g_{\mathrm{SAM}}=\frac1M\sum_j\nabla L_j(\theta+\hat\epsilon_j)`. Derivation: the
*Sharpness-aware posteriors* page of the documentation (``docs/methods/sharpness-aware.md``).

Why a closure and not a :class:`pyro.optim.PyroOptim`: SAM needs a global norm and a second gradient evaluation at
the perturbed point, which a per-tensor Pyro optimizer cannot do. With a Pyro model, build the closure from a Pyro
loss over a **fixed** minibatch (both passes must score the same data), e.g. with ``AutoDelta`` (MAP; the prior acts
as weight decay)::

    guide = AutoDelta(model); guide(x[:1], y[:1])               # create the parameters
    opt = SAM(guide.parameters(), torch.optim.Adam, rho=0.05, lr=1e-3)
    elbo = Trace_ELBO()
    idx = torch.randperm(N)[:B]                                  # one minibatch for both passes
    opt.step(lambda: (elbo.differentiable_loss(model, guide, x[idx], y[idx], num_data=N) / N).backward())

The closure runs twice per step; the second evaluation replays the first (:mod:`pyro_flat.infer.replay`: the same
random numbers, ``pyro.plate`` subsample indices, BatchNorm running statistics left unchanged).

**Cheaper steps** (``looksam_k``, ``looksam_alpha``, ``esam_gamma``, ``rst_p``; every default gives SAM's step):
LookSAM, ESAM and RST: see :mod:`pyro_flat.ops.efficient_sam` (references there); with m-sharpness LookSAM's
gradients are the sub-batch means and ESAM selects in each sub-batch (the *Cheaper steps* page,
``docs/methods/cheaper-steps.md``).

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

from .._validation import check_real
from ..ops.efficient_sam import DEFAULT_LOOKSAM_ALPHA, SAM_STEP, SharpnessSchedule, check_esam_gamma
from ..ops.sam import check_radius, sam_perturbation
from ._common import (
    Closure,
    PerExampleClosure,
    as_closures,
    ascent_gradients,
    gradients_at,
    looksam_step,
    mean_loss,
    recorded_gradients_at,
)


class SAM(Optimizer):
    r"""SAM around a base :class:`torch.optim.Optimizer`: two gradient evaluations per step, global-norm ascent.

    :param params: the parameters (an iterable of tensors or of parameter-group dicts).
    :param base_optimizer: the base optimizer *class* (or any factory ``base_optimizer(param_groups, **kwargs)``),
        e.g. ``torch.optim.SGD``; it shares this optimizer's ``param_groups``, so learning-rate schedulers can act
        on either.
    :param float rho: the radius :math:`\rho\ge0`; default 0.05 (the SAM paper's CIFAR value [1]).
        ``rho=0`` gives the base optimizer at twice the cost.
    :param bool adaptive: use ASAM's elementwise scaling :math:`|\theta|` [2]; default ``False``.
    :param int looksam_k: LookSAM's period :math:`k\ge1`: the SAM gradient every :math:`k`-th step, the reused
        direction in between; default 1 (SAM at every step; the paper uses 5).
    :param float looksam_alpha: LookSAM's :math:`\alpha\ge0`; default 0.7 (the paper's).
    :param float esam_gamma: ESAM's :math:`\gamma\in(0,1]`, the fraction of each minibatch the SAM gradient is
        taken on; default 1 (the whole minibatch; the paper uses 0.5). Below 1 the closure protocol changes (below).
    :param float rst_p: RST's probability :math:`p\in[0,1]` of a SAM step; default 1 (every step; the paper's
        constant schedule uses 0.5).
    :param rst_seed: the seed of RST's choices (default: drawn once from torch's CPU generator; see
        :class:`~pyro_flat.ops.efficient_sam.SharpnessSchedule`).
    :param base_kwargs: arguments of the base optimizer (``lr``, ``momentum``, ``weight_decay``, ...).

    ``step(closure)`` takes a closure that zeroes nothing itself (the optimizer sets ``.grad`` to ``None`` before
    every call), evaluates the mean minibatch loss, calls ``backward()`` and returns the loss; or a sequence of
    such closures, one per sub-batch (m-sharpness). It returns the mean of the closures' losses at the
    unperturbed :math:`\theta` (a detached tensor, no host sync). On return ``p.grad`` holds
    :math:`g_{\mathrm{SAM}}` (on a LookSAM reuse step its estimate, on an RST base step :math:`g`).

    With ``esam_gamma < 1`` a closure is called as ``closure(subset)`` and returns the **per-example** losses of its
    minibatch (``subset=None``) or of the examples at the positions ``subset`` (a 1-D ``LongTensor``), a 1-D tensor,
    *without* calling ``backward()`` (the optimizer differentiates their mean): a step evaluates it at :math:`\theta`,
    at :math:`\theta+\hat\epsilon` without gradients (to select), and at :math:`\theta+\hat\epsilon` on the
    selection, the later calls replaying the first one's random numbers.

    ``state_dict()`` holds the base optimizer's state (key ``"base_optimizer"``), the schedule of LookSAM/RST (key
    ``"schedule"``) and LookSAM's direction :math:`g_v` (per parameter, ``"looksam_direction"``).

    :raises ValueError: for a bad ``rho``, ``lr`` (not a finite number >= 0), ``adaptive``, base optimizer or
        cheaper-step option (LookSAM and RST together included).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        base_optimizer: Callable[..., Optimizer],
        rho: float = 0.05,
        adaptive: bool = False,
        *,
        looksam_k: int = 1,
        looksam_alpha: float = DEFAULT_LOOKSAM_ALPHA,
        esam_gamma: float = 1.0,
        rst_p: float = 1.0,
        rst_seed: int | None = None,
        **base_kwargs: Any,
    ) -> None:
        if not callable(base_optimizer):
            raise ValueError(f"SAM: `base_optimizer` must be an optimizer class or factory, got {base_optimizer!r}")
        if not isinstance(adaptive, bool):
            raise ValueError(f"SAM: `adaptive` must be a bool, got {adaptive!r}")
        self.rho = check_radius(rho)
        self.adaptive = adaptive
        self.esam_gamma = check_esam_gamma("SAM", esam_gamma)
        self.schedule = SharpnessSchedule("SAM", looksam_k, looksam_alpha, rst_p, rst_seed)
        super().__init__(params, dict(base_kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        if not isinstance(self.base_optimizer, Optimizer):
            raise ValueError(f"SAM: `base_optimizer` must build a torch.optim.Optimizer, got {self.base_optimizer!r}")
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if "lr" in self.param_groups[-1]:  # as the base optimizer's own check, but a non-finite lr refused too
            check_real(self.param_groups[-1]["lr"], "lr", low=0, owner="SAM")

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def perturbation(self, grads: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
        r""":math:`\hat\epsilon` for the gradients ``grads`` at ``params`` (global norm over all of them)."""
        return sam_perturbation(grads, self.rho, adaptive=self.adaptive, params=params)

    @torch.no_grad()
    def step(self, closure: Closure | PerExampleClosure | Sequence[Closure | PerExampleClosure] | None = None) -> (
        Tensor | None
    ):  # type: ignore[override]
        """One SAM step (a LookSAM reuse step or an RST base step when the schedule says so); see the class docstring
        for the closure protocol."""
        closures = as_closures("SAM", closure)
        params = self._params()
        kind = self.schedule.next_step()
        per_example = self.esam_gamma < 1
        losses, grad_sum, first_sum = [], None, None
        origin = [p.detach().clone() for p in params] if kind == SAM_STEP else None
        for c in closures:
            if kind != SAM_STEP:  # one gradient evaluation at theta
                loss, grads = gradients_at(c, params, per_example=per_example)
                first, grads = grads, grads
            else:
                loss, first, run = recorded_gradients_at(c, params, per_example=per_example)
                torch._foreach_add_(params, self.perturbation(first, origin))
                grads = ascent_gradients(c, params, run, loss, self.esam_gamma)
                torch._foreach_copy_(params, origin)
            losses.append(loss.mean() if per_example else loss)
            grad_sum = _accumulate(grad_sum, grads, len(closures))
            if self.schedule.looksam:
                first_sum = _accumulate(first_sum, first, len(closures))
        if len(closures) > 1:
            torch._foreach_div_(grad_sum, float(len(closures)))
            if first_sum is not None and first_sum is not grad_sum:
                torch._foreach_div_(first_sum, float(len(closures)))
        if self.schedule.looksam:
            grad_sum = looksam_step(self, kind, params, first_sum, grad_sum, self.schedule.looksam_alpha)
        for p, g in zip(params, grad_sum, strict=True):
            p.grad = g
        self.base_optimizer.step()
        return mean_loss(losses)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["base_optimizer"] = self.base_optimizer.state_dict()
        state["schedule"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        base = state_dict.pop("base_optimizer", None)
        if base is None:
            raise ValueError("SAM.load_state_dict: the state has no 'base_optimizer' entry (not saved by SAM?)")
        schedule = state_dict.pop("schedule", None)
        if schedule is not None:
            self.schedule.load_state_dict(schedule)
        self.base_optimizer.load_state_dict(base)
        super().load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups


def _accumulate(total: list[Tensor] | None, grads: list[Tensor], count: int) -> list[Tensor]:
    """``total + grads`` (the first ``grads`` themselves for one closure, a copy for several)."""
    if total is None:
        return [g.clone() for g in grads] if count > 1 else grads
    torch._foreach_add_(total, grads)
    return total


__all__ = ["SAM"]

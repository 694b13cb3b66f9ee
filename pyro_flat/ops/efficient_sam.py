r"""Cheaper sharpness-aware steps: LookSAM [1], ESAM's sharpness-sensitive data selection [2] and RST [3].

A SAM step [4] evaluates two gradients of the minibatch loss :math:`L`: :math:`g=\nabla L(\theta)` for the ascent
:math:`\hat\epsilon=\rho g/\|g\|_2`, and the SAM gradient :math:`g_s=\nabla L(\theta+\hat\epsilon)` that the
optimizer steps with. Each method below spends less; every default is SAM.

**LookSAM** [1] computes :math:`g_s` only on every :math:`k`-th step, keeping its component orthogonal to :math:`g`,
:math:`g_v = g_s - \langle g, g_s\rangle g/\|g\|_2^2`; the :math:`k-1` steps in between evaluate :math:`g` only and
step with

.. math:: g_s \approx g + \alpha\,\frac{\|g\|_2}{\|g_v\|_2}\, g_v,

norms and inner products global over all tensors (the paper's Algorithm 1; :math:`k=5`, :math:`\alpha=0.7` there).

**ESAM's sharpness-sensitive data selection (SDS)** [2] takes the ascent on the whole minibatch :math:`B` and the SAM
gradient :math:`g_s = \nabla L_{B^+}(\theta+\hat\epsilon)` on the :math:`\max(1,\lfloor\gamma|B|\rfloor)` examples
:math:`B^+` whose loss rises most, :math:`\ell_i(\theta+\hat\epsilon)-\ell_i(\theta)` (one forward pass at
:math:`\theta+\hat\epsilon` without gradients finds them; a fixed size, where the authors' code keeps one fewer; the
paper uses :math:`\gamma=0.5`). ESAM's stochastic weight perturbation saves nothing in a dense framework: not offered.

**RST** [3] makes each step a SAM step with probability :math:`p` and a step of the base method (:math:`g` alone)
otherwise: :math:`1+p` gradient evaluations expected (the paper's constant schedule, :math:`p=0.5` there).

:class:`SharpnessSchedule` decides what each step computes. How the sharpness-aware transform, the SA-ELBOs,
:class:`~pyro_flat.optim.SAM` and :class:`~pyro_flat.optim.BayesianSAM` take these steps, and where this
implementation departs from the authors' code: the *Cheaper steps* page of the documentation
(``docs/methods/cheaper-steps.md``).

References:
    * [1] `Towards Efficient and Scalable Sharpness-Aware Minimization`, Yong Liu, Siqi Mai, Xiangning Chen,
      Cho-Jui Hsieh, Yang You (CVPR 2022), arXiv:2203.02714
    * [2] `Efficient Sharpness-aware Minimization for Improved Training of Neural Networks`, Jiawei Du, Hanshu Yan,
      Jiashi Feng, Joey Tianyi Zhou, Liangli Zhen, Rick Siow Mong Goh, Vincent Y. F. Tan (ICLR 2022),
      arXiv:2110.03141
    * [3] `Randomized Sharpness-Aware Training for Boosting Computational Efficiency in Deep Learning`, Yang Zhao,
      Hao Zhang, Xiuyuan Hu (2022), arXiv:2203.09962
    * [4] `Sharpness-Aware Minimization for Efficiently Improving Generalization`, Pierre Foret, Ariel Kleiner,
      Hossein Mobahi, Behnam Neyshabur (ICLR 2021), arXiv:2010.01412
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._validation import check_int, check_real
from .tree import global_norm, tree_dot

SAM_STEP = "sam"
"""A step that takes the ascent and evaluates the SAM gradient (for LookSAM: a step that refreshes :math:`g_v`)."""
REUSE_STEP = "reuse"
"""A LookSAM step between refreshes: the gradient at :math:`\\theta` plus the reused direction :math:`g_v`."""
BASE_STEP = "base"
"""An RST step without the ascent: the base method's gradient at :math:`\\theta`."""

DEFAULT_LOOKSAM_ALPHA = 0.7
"""LookSAM's :math:`\\alpha` (the paper's value)."""


def looksam_direction(grads: Sequence[Tensor], sam_grads: Sequence[Tensor], eps: float = 1e-12) -> list[Tensor]:
    r"""LookSAM's :math:`g_v=g_s-\langle g,g_s\rangle g/\|g\|_2^2`: the part of the SAM gradient ``sam_grads``
    orthogonal to the gradient ``grads`` (inner product and norm global over the tensors; ``eps`` keeps a zero
    gradient finite)."""
    coefficient = tree_dot(grads, sam_grads) / (tree_dot(grads, grads) + eps)
    return [s - coefficient * g for g, s in zip(grads, sam_grads, strict=True)]


def looksam_gradient(grads: Sequence[Tensor], directions: Sequence[Tensor], alpha: float, eps: float = 1e-12) -> list[
    Tensor
]:
    r"""LookSAM's gradient between refreshes, :math:`g+\alpha\,\|g\|_2\,g_v/\|g_v\|_2` (global norms; a zero
    :math:`g_v` adds nothing)."""
    scale = alpha * global_norm(grads) / (global_norm(directions) + eps)
    return [g + scale * v for g, v in zip(grads, directions, strict=True)]


def selection_size(batch_size: int, gamma: float) -> int:
    r""":math:`\max(1,\lfloor\gamma B\rfloor)`, the number of examples ESAM's data selection keeps."""
    return max(1, math.floor(gamma * batch_size + 1e-9))


def sharpness_sensitive_selection(losses: Tensor, perturbed_losses: Tensor, gamma: float) -> Tensor:
    r"""ESAM's :math:`B^+`: the positions (sorted) of the :func:`selection_size` examples with the largest loss
    increase ``perturbed_losses - losses`` (1-D tensors over the minibatch). Computed on the device (``topk``), with a
    size fixed by the minibatch's: no host read."""
    if losses.dim() != 1 or losses.shape != perturbed_losses.shape:
        raise ValueError(
            "ESAM's data selection needs one loss per example (two 1-D tensors of equal length), got shapes "
            f"{tuple(losses.shape)} and {tuple(perturbed_losses.shape)}"
        )
    increase = (perturbed_losses - losses).detach()
    return torch.topk(increase, selection_size(len(increase), gamma), sorted=False).indices.sort().values


def check_esam_gamma(owner: str, gamma: object) -> float:
    r"""ESAM's :math:`\gamma\in(0,1]` as a float, or a ``ValueError`` naming ``owner``."""
    return check_real(gamma, "esam_gamma", low=0.0, high=1.0, low_open=True, owner=owner)


class SharpnessSchedule:
    r"""What each step of a sharpness-aware method computes: every step a SAM step (the default), LookSAM's refresh
    every ``looksam_k`` steps with reuse steps in between, or RST's SAM step with probability ``rst_p`` and a base
    step otherwise (see the module docstring).

    Its random choices come from a Python :class:`random.Random` (a Mersenne Twister), seeded once from torch's CPU
    generator when the schedule is made (or from ``rst_seed``): the choice of a step reads no tensor, so it makes no
    host synchronisation on a GPU; it is known before the step runs (a step that takes no ascent skips its passes
    instead of computing and discarding them, and a compiled step can be captured once per kind); and it is part of
    :meth:`state_dict`, so a run resumed from a checkpoint makes the same choices as an uninterrupted one.

    :param str owner: the object it schedules, for error messages.
    :param int looksam_k: LookSAM's period :math:`k\ge1` (1: every step is a SAM step).
    :param float looksam_alpha: LookSAM's :math:`\alpha\ge0`; default 0.7 [1].
    :param float rst_p: RST's probability :math:`p\in[0,1]` of a SAM step (1: every step).
    :param rst_seed: the seed of RST's choices; default ``None``: drawn once from torch's CPU generator when the
        schedule is made (so ``torch.manual_seed`` / ``pyro.set_rng_seed`` before it make a run reproducible). Not
        drawn at all with ``rst_p=1``, which leaves torch's random stream as it was.
    :raises ValueError: for a value out of range, or LookSAM and RST together (each decides which steps take the
        ascent).

    :ivar dict directions: LookSAM's :math:`g_v` by name, for an owner that keeps them here (the sharpness-aware
        transform, by latent site; the optimizers keep theirs in their per-parameter state). Updated in place, so that
        a compiled step that reads them sees the current values.
    """

    def __init__(
        self,
        owner: str,
        looksam_k: int = 1,
        looksam_alpha: float = DEFAULT_LOOKSAM_ALPHA,
        rst_p: float = 1.0,
        rst_seed: int | None = None,
    ) -> None:
        self.owner = owner
        self.looksam_k = check_int(looksam_k, "looksam_k", minimum=1, owner=owner)
        self.looksam_alpha = check_real(looksam_alpha, "looksam_alpha", low=0.0, owner=owner)
        self.rst_p = check_real(rst_p, "rst_p", low=0.0, high=1.0, owner=owner)
        if rst_seed is not None:
            check_int(rst_seed, "rst_seed", minimum=0, owner=owner)
        if self.looksam_k > 1 and self.rst_p < 1:
            raise ValueError(
                f"{owner}: LookSAM (looksam_k={looksam_k}) and RST (rst_p={rst_p}) each decide which steps take the "
                "ascent; use one of them"
            )
        self.steps = 0
        self.directions: dict[str, Tensor] = {}
        self._random: random.Random | None = None
        if self.rst_p < 1:
            seed = int(torch.randint(2**62, (), device="cpu")) if rst_seed is None else rst_seed
            self._random = random.Random(seed)

    @property
    def looksam(self) -> bool:
        """Whether LookSAM reuses its direction (``looksam_k > 1``)."""
        return self.looksam_k > 1

    @property
    def active(self) -> bool:
        """Whether some steps are not SAM steps (LookSAM or RST in use)."""
        return self.looksam_k > 1 or self.rst_p < 1

    def next_step(self) -> str:
        """The kind of the next step (:data:`SAM_STEP`, :data:`REUSE_STEP` or :data:`BASE_STEP`); advances the
        schedule."""
        if self.looksam_k > 1:
            kind = SAM_STEP if self.steps % self.looksam_k == 0 else REUSE_STEP
        elif self._random is not None:
            kind = SAM_STEP if self._random.random() < self.rst_p else BASE_STEP
        else:
            kind = SAM_STEP
        self.steps += 1
        return kind

    def peek_step(self) -> str:
        """The kind of the next step, leaving the schedule where it is (for a caller that may not take the step)."""
        state = None if self._random is None else self._random.getstate()
        steps = self.steps
        kind = self.next_step()
        self.steps = steps
        if state is not None:
            self._random.setstate(state)
        return kind

    def state_dict(self) -> dict[str, Any]:
        """The number of steps taken, the state of RST's random generator and LookSAM's directions (copies)."""
        return {"steps": self.steps, "random": None if self._random is None else self._random.getstate(),
                "directions": {name: d.detach().clone() for name, d in self.directions.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (directions copied into the tensors already kept, if shaped alike)."""
        if (state.get("random") is None) != (self._random is None):
            raise ValueError(f"{self.owner}: the saved schedule is {'not ' if state.get('random') is None else ''}"
                             f"RST's, this one is {'not ' if self._random is None else ''}(rst_p={self.rst_p})")
        self.steps = int(state["steps"])
        if self._random is not None:
            self._random.setstate(_as_random_state(state["random"]))
        for name, saved in state.get("directions", {}).items():
            kept = self.directions.get(name)
            if kept is not None and kept.shape == saved.shape:
                kept.copy_(saved)
            else:
                self.directions[name] = saved.detach().clone()

    def __repr__(self) -> str:
        return (f"SharpnessSchedule(looksam_k={self.looksam_k}, looksam_alpha={self.looksam_alpha}, "
                f"rst_p={self.rst_p}, steps={self.steps})")


def _as_random_state(state: Any) -> tuple:
    """A :meth:`random.Random.getstate` value again after a round trip through a checkpoint (lists for tuples)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


__all__ = [
    "BASE_STEP",
    "DEFAULT_LOOKSAM_ALPHA",
    "REUSE_STEP",
    "SAM_STEP",
    "SharpnessSchedule",
    "check_esam_gamma",
    "looksam_direction",
    "looksam_gradient",
    "selection_size",
    "sharpness_sensitive_selection",
]

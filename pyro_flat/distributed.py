r"""Data-parallel training with :mod:`torch.distributed`: the all-reduced ascent of the flat objectives, and DDP.

With :math:`R` processes ("ranks"), each holding an equal shard :math:`\mathcal B_r` of a minibatch
:math:`\mathcal B=\cup_r\mathcal B_r` (:math:`|\mathcal B_r|=B/R`) and calling the model with ``num_data=N``, rank
:math:`r`'s log-likelihood is :math:`\ell_r=\frac{N}{B/R}\sum_{i\in\mathcal B_r}\log p(y_i\mid x_i,\theta)`, so the
mean over ranks is the single-process minibatch log-likelihood :math:`\ell_{\mathcal B}=\frac NB
\sum_{i\in\mathcal B}\log p(y_i\mid x_i,\theta)` and the mean of the ranks' gradients is its gradient.
:class:`~torch.nn.parallel.DistributedDataParallel` averages the gradients of the final loss this way. The flat
objectives take a gradient *inside* the loss as well — the SAM ascent direction :math:`\hat g` of
:class:`~pyro_flat.infer.SharpnessAwareELBO` / :func:`~pyro_flat.transforms.sharpness_aware`, the data-term gradient
:math:`g` of :class:`~pyro_flat.infer.KLBallELBO`'s Fisher direction — and that one must be averaged too, *before*
its norm is taken: with ``distributed=True`` they call :func:`all_reduce_mean` on it, so the perturbation is the
same on every rank and equals the single-process one on the combined batch. Without it every rank would perturb
along its own shard's gradient (a smaller-batch, noisier ascent, different on each rank).

Two more requirements, which the recipe below meets:

* **the same random numbers on every rank**: the guide's draws :math:`\theta` (and bSAM's noise) must be identical
  across ranks, so every rank calls ``pyro.set_rng_seed(seed)`` with the same seed; only the data differ;
* **equal shards**: with unequal shards the mean of the ranks' losses weights the examples unequally (drop the last
  incomplete batch, as :class:`~torch.utils.data.distributed.DistributedSampler` with ``drop_last=True`` does).

The recipe, Pyro's ``ELBOModule`` route (:meth:`pyro.infer.ELBO.__call__`) wrapped in DDP::

    torch.distributed.init_process_group("nccl")          # "gloo" on CPU; torchrun sets RANK, WORLD_SIZE, ...
    pyro.set_rng_seed(0)                                   # the same seed on every rank
    guide = AutoNormal(model); guide(x_shard, y_shard, num_data=N)   # create the parameters (same on all ranks)
    loss = ddp_elbo(model, guide, SharpnessAwareELBO(rho=0.05, distributed=True))
    optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
    for x_shard, y_shard in loader:                        # this rank's shard of each minibatch
        optim.zero_grad()
        loss(x_shard, y_shard, num_data=N).backward()      # DDP all-reduces the parameter gradients
        optim.step()

.. warning:: With ``distributed=True`` every call of the loss is a collective: all ranks must evaluate it equally often
    (e.g. ``SVI.evaluate_loss`` on rank 0 alone would wait forever for the others). End a run with
    ``dist.barrier()`` before ``destroy_process_group()`` when one rank does extra work (such as evaluation).

:class:`~pyro_flat.optim.BayesianSAM` and :class:`~pyro_flat.optim.SAM` need no option: both gradients of their
closure come from ``backward()`` through the DDP-wrapped network, which DDP all-reduces, and bSAM's noise is the same
on every rank once the ranks are seeded alike.

**BatchNorm.** In training mode a BatchNorm layer normalises by the statistics of the batch it sees: each rank's own
shard, so :math:`R` ranks with :math:`B/R` examples each are not one process with :math:`B`. :func:`convert_batchnorm`
turns its BatchNorm layers into :class:`GlobalBatchNorm`, which normalises by the mean and variance of the whole
global batch (summed over the ranks with a differentiable ``all_reduce``, so the gradients flow through the other
ranks' examples too) and updates the running statistics with them: PyTorch's :class:`~torch.nn.SyncBatchNorm`
semantics on every device (``SyncBatchNorm`` runs on GPUs only; the harness uses it there and
``GlobalBatchNorm`` on the CPU). Passes in which every rank sees the *same* inputs — a BatchNorm refresh on the whole
training set before evaluating a posterior draw — belong inside :func:`local_batchnorm`: summed over the ranks they
would count each example :math:`R` times (the unbiased running variance would differ by about :math:`1/(2n)`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from pyro.infer import ELBO
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ._internals import BatchNormBase

__all__ = [
    "GlobalBatchNorm",
    "all_reduce_mean",
    "check_distributed",
    "check_same_random_state",
    "convert_batchnorm",
    "ddp_elbo",
    "local_batchnorm",
    "shard_size",
]


def check_distributed(owner: str) -> None:
    """Raise a ``ValueError`` naming ``owner`` unless :mod:`torch.distributed` is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{owner}: distributed=True needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun); use distributed=False in one process"
        )


def all_reduce_mean(tensors: Sequence[Tensor], group: object | None = None) -> list[Tensor]:
    r"""The mean over the ranks of ``group`` of each tensor, :math:`\frac1R\sum_r t^{(r)}`, in one collective.

    The tensors are flattened into one buffer (one ``all_reduce`` instead of one per tensor), summed across ranks and
    divided by the group's size; the inputs are not modified.

    :param tensors: tensors of one dtype and device (e.g. the per-site gradients); shapes may differ.
    :param group: the process group (default: the world).
    :returns: new tensors with the inputs' shapes.
    """
    check_distributed("all_reduce_mean")
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat = flat / dist.get_world_size(group)
    out, pos = [], 0
    for t in tensors:
        out.append(flat[pos : pos + t.numel()].view_as(t))
        pos += t.numel()
    return out


def ddp_elbo(model: nn.Module, guide: nn.Module, elbo: ELBO, **ddp_kwargs: object) -> DistributedDataParallel:
    """Pyro's ``ELBOModule`` for ``(model, guide)`` wrapped in :class:`~torch.nn.parallel.DistributedDataParallel`.

    Calling the result with the model's arguments (this rank's shard, ``num_data=N``) returns the rank's loss; its
    ``backward()`` leaves the mean of the ranks' gradients in the guide's (and model's) parameters.

    :param model: the Pyro model, a ``PyroModule``.
    :param guide: the guide, a ``PyroModule`` whose parameters already exist (call it once first).
    :param elbo: the objective, e.g. ``Trace_ELBO()``, ``SharpnessAwareELBO(rho, distributed=True)`` or
        ``KLBallELBO(radius, distributed=True)``.
    :param ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``device_ids=[local_rank]`` on GPUs).
    """
    check_distributed("ddp_elbo")
    if not isinstance(elbo, ELBO):
        raise ValueError(f"`elbo` must be a pyro.infer.ELBO instance, got {type(elbo).__name__}")
    if not isinstance(model, nn.Module) or not isinstance(guide, nn.Module):
        raise ValueError("`model` and `guide` must be torch modules (PyroModule / AutoGuide) for Pyro's ELBOModule")
    module = elbo(model, guide)
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("ddp_elbo: the guide has no parameters yet; call guide(*args, **kwargs) once before")
    check_same_random_state(next(module.parameters()).device)
    return DistributedDataParallel(module, **ddp_kwargs)


def check_same_random_state(device: torch.device | str = "cpu", group: object | None = None) -> None:
    """Raise a ``ValueError`` unless torch's CPU random state (and the current CUDA one, if CUDA is initialised) is the
    same on every rank of ``group``: the guide's draws and bSAM's noise must agree across ranks.

    A collective (every rank must call it); it compares a checksum of the generator states with one ``all_reduce``.
    """
    check_distributed("check_same_random_state")
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    weights = torch.arange(1, sum(len(s) for s in states) + 1, dtype=torch.float64)
    checksum = (torch.cat(states).to(torch.float64) * weights).sum()
    bounds = torch.stack([checksum, -checksum]).to(device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(bounds[0], -bounds[1]):  # max == min: every rank holds the same checksum
        raise ValueError(
            "the ranks' random states differ: seed every rank with the same seed (pyro.set_rng_seed(seed) on all "
            "ranks) before building the guide, so that the guide draws the same latent values everywhere"
        )


def shard_size(batch_size: int, world_size: int) -> int:
    """Each rank's share of a global minibatch of ``batch_size`` examples split over ``world_size`` ranks.

    :raises ValueError: if ``world_size`` does not divide ``batch_size`` (the ranks' shards must be equal for their
        averaged gradient to be the gradient of the whole batch).
    """
    if batch_size % world_size:
        raise ValueError(f"the batch size {batch_size} must be divisible by the number of processes {world_size}")
    return batch_size // world_size


class _AllReduceSum(torch.autograd.Function):
    """The sum over the ranks of a tensor, differentiable: the gradient of each rank's input is the sum over the
    ranks of the gradients of the output (every rank calls backward as often as forward)."""

    @staticmethod
    def forward(ctx: object, tensor: Tensor, group: object) -> Tensor:
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return _AllReduceSum.apply(grad, ctx.group), None


class GlobalBatchNorm(BatchNormBase):
    r"""BatchNorm over the global batch of all ranks: the semantics of :class:`torch.nn.SyncBatchNorm`, on any device
    (``SyncBatchNorm`` runs on GPUs only, and DDP refuses it in a CPU module).

    In training mode under an initialised process group, with :math:`x` this rank's shard and sums over every rank's
    examples :math:`n` (all positions of a channel), the layer computes

    .. math:: \mu = \frac1n\sum x,\qquad \sigma^2 = \frac1n\sum (x-\mu)^2,\qquad
        y = \gamma\,\frac{x-\mu}{\sqrt{\sigma^2+\epsilon}} + \beta

    (two ``all_reduce`` s of the per-channel sums, differentiable), and moves the running mean and the unbiased
    running variance :math:`\frac{n}{n-1}\sigma^2` by ``momentum``, as one process with the whole batch does. In
    eval mode or without a process group it is plain BatchNorm. The statistics are computed in at least float32 (bf16
    autocast inputs). On GPUs ``SyncBatchNorm``'s fused kernels do the same with fewer launches (the harness uses
    them there).

    :param num_features: the channels :math:`C` of ``[B, C, ...]`` inputs; ``eps``, ``momentum``, ``affine`` and
        ``track_running_stats`` are BatchNorm's.
    :param process_group: the ranks whose batches form the global batch (default: the world).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: object | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GlobalBatchNorm: expected inputs [B, C, ...], got shape {tuple(input.shape)}")

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        self._check_input_dim(input)
        group = self.process_group or dist.group.WORLD
        dtype = torch.promote_types(input.dtype, torch.float32)
        x = input.to(dtype)
        dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
        local = torch.cat([x.sum(dims), x.new_full((1,), x.numel() / x.shape[1])])
        total = _AllReduceSum.apply(local, group)
        count = total[-1]
        mean = total[:-1] / count
        centred = x - mean.reshape(shape)
        var = _AllReduceSum.apply(centred.square().sum(dims), group) / count
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                unbiased = var.detach() * count / (count - 1).clamp_min(1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return out.to(input.dtype)


def convert_batchnorm(module: nn.Module, process_group: object | None = None) -> nn.Module:
    """``module`` with every BatchNorm layer replaced by a :class:`GlobalBatchNorm` holding the same parameters,
    running statistics and mode (the module itself if it is one BatchNorm layer): for data-parallel training whose
    ranks together equal one process with the global batch.

    :param module: a network.
    :param process_group: the ranks whose batches form the global batch (default: the world).
    """
    if isinstance(module, BatchNormBase) and not isinstance(module, GlobalBatchNorm):
        converted = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                    module.track_running_stats, process_group)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        if module.track_running_stats:
            converted.running_mean, converted.running_var = module.running_mean, module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        return converted.train(module.training)
    for name, child in module.named_children():
        converted = convert_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module


@contextmanager
def local_batchnorm(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s BatchNorm layers that normalise over the global batch
    (:class:`GlobalBatchNorm`, :class:`torch.nn.SyncBatchNorm`) use their own input only, as plain BatchNorm: for
    passes in which every rank sees the same inputs (e.g. :func:`~pyro_flat.nn.refresh_batchnorm` on the whole
    training set), where the summed statistics would count each example once per rank."""
    layers = [m for m in module.modules() if isinstance(m, (GlobalBatchNorm, nn.SyncBatchNorm))]
    for layer in layers:
        layer.forward = partial(BatchNormBase.forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward

"""What a method receives (:class:`Problem`) and what it returns (:class:`Posterior`), plus the shared SVI loop."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyro
import pyro.optim
import torch
from pyro import poutine
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .._internals import unconstrained_params
from ..data import ClassificationData
from ..data.images import VisionData
from ..distributed import ddp_elbo
from ..infer import JitTensorTrace_ELBO, TensorSVI, TensorTrace_ELBO
from ..infer.predict import guide_draws, sample_draws
from ..nn import BayesianClassifier
from ..runtime.compiled_calls import CompiledCalls, module_key, tensor_key
from .batches import is_distributed, minibatch_size, shard_size, steps_per_epoch, world
from .config import COMPILE_AUTO_STEPS, RunConfig
from .context import RunContext
from .loop import TrainingLoop
from .models import MODELS
from .registry import METHODS, lookup
from .schedules import CosineDecay
from .streams import LoaderStream, TensorStream, stream_seed

__all__ = ["CosineDecay", "LossModule", "OptimSpec", "Posterior", "Problem", "run_svi", "to_device", "world"]


@dataclass
class OptimSpec:
    """The optimizer of a training phase, as a Pyro optimizer for ``SVI`` or a torch optimizer for a DDP loss.

    :param cls: the torch optimizer class (``Adam`` or ``SGD``).
    :param args: its arguments (``lr`` on the scale of the loss it will see).
    :param lr_lambda: a multiplier of the learning rate per step (``LambdaLR``), or ``None``.
    """

    cls: type[torch.optim.Optimizer]
    args: dict[str, Any]
    lr_lambda: Callable[[int], float] | None = None

    def pyro(self) -> pyro.optim.PyroOptim:
        """A Pyro optimizer (a ``LambdaLR`` scheduler when there is a schedule: call its ``step()`` every step)."""
        if self.lr_lambda is None:
            return pyro.optim.PyroOptim(self.cls, dict(self.args))
        return pyro.optim.LambdaLR({"optimizer": self.cls, "optim_args": dict(self.args), "lr_lambda": self.lr_lambda})

    def torch(self, params: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR | None]:
        """A torch optimizer over ``params`` and its ``LambdaLR`` (``None`` without a schedule)."""
        optimizer = self.cls(params, **self.args)
        if self.lr_lambda is None:
            return optimizer, None
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda)


class LossModule(nn.Module):
    """A loss ``fn(*args, **kwargs)`` as a module holding the modules whose parameters it trains — what
    ``DistributedDataParallel`` wraps to all-reduce their gradients.

    :param compiled: evaluate the loss through its captured step (:class:`~pyro_flat.runtime.compiled_calls
        .CompiledCalls`, compiled with ``torch.compile``), as a function of the parameters it reads (Pyro's and the
        modules') and of its tensor arguments: a closure optimizer's compiled step (BayesianSAM's).
    """

    def __init__(self, fn: Callable[..., Tensor], *modules: nn.Module, compiled: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.parts = nn.ModuleList(modules)
        self._compiled = CompiledCalls("the loss of a closure optimizer") if compiled else None
        self._param_names: dict[Hashable, list[str]] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if self._compiled is None:
            return self.fn(*args, **kwargs)
        tensors, arg_key = tensor_key((args, kwargs))
        key = (arg_key, module_key(*self.parts), torch.is_grad_enabled())

        def step() -> Tensor:
            with poutine.trace(param_only=True) as params:
                loss = self.fn(*args, **kwargs)
            self._param_names[key] = sorted(params.trace.nodes)
            return loss

        def inputs() -> list[Tensor]:
            store = unconstrained_params()
            read = [store[name] for name in self._param_names[key]] + list(self.parts.parameters()) + tensors
            return list({id(t): t for t in read}.values())  # a module's parameter may be Pyro's too

        return self._compiled(key, step, inputs)


@dataclass
class Problem:
    """A dataset (already on the run's device and dtype), the run's hyperparameters, the job's seed and its
    :class:`~pyro_flat.bench.loop.RunContext` (checkpoints, progress, logs)."""

    data: ClassificationData
    config: RunConfig
    seed: int = 0
    context: RunContext = field(default_factory=RunContext)

    @property
    def rank(self) -> int:
        return world()[0]

    @property
    def world_size(self) -> int:
        return world()[1]

    @property
    def distributed(self) -> bool:
        """Whether the run is data-parallel (a ``torch.distributed`` process group exists, e.g. under ``torchrun``,
        even with one process): minibatches are then sharded and the losses wrapped in DDP."""
        return is_distributed()

    @property
    def uses_loader(self) -> bool:
        """Whether minibatches come from a ``DataLoader`` of augmented images (else from the tensors)."""
        return isinstance(self.data, VisionData) and self.config.augment

    @property
    def batch_size(self) -> int:
        """The global minibatch :math:`B` (:func:`~pyro_flat.bench.batches.minibatch_size`)."""
        return minibatch_size(self.config.batch_size, self.data.num_data)

    @property
    def shard_size(self) -> int:
        """This rank's share of the global minibatch (all of it in one process)."""
        return shard_size(self.batch_size, self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        """Minibatches per pass over the training set (the last incomplete one is dropped when data-parallel)."""
        return steps_per_epoch(self.data.num_data, self.batch_size, drop_last=self.distributed)

    @property
    def num_steps(self) -> int:
        """Optimisation steps of a method with the run's epoch budget."""
        return self.config.num_epochs * self.steps_per_epoch

    def build_model(self, *, dropout: float = 0.0) -> BayesianClassifier:
        """A fresh model of the run's architecture on the run's device and dtype (memory format, autocast), initialised
        in the run's dtype whatever torch's default dtype is (so a run is a function of its configuration)."""
        build = lookup(MODELS, "model", self.config.model)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.data.dtype)  # torch's initialisers draw in the dtype a layer is made in
        try:
            model = build(self.data, self.config, dropout=dropout)
        finally:
            torch.set_default_dtype(previous)
        model = model.to(device=self.data.device, dtype=self.data.dtype)
        if self.config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.config.precision == "bf16":
            model.autocast = torch.bfloat16
        return model

    @property
    def compiled(self) -> bool:
        """Whether the method trains through its compiled step: ``config.compile``, or with ``None`` in one process on
        CUDA for at least :data:`~pyro_flat.bench.config.COMPILE_AUTO_STEPS` steps."""
        if self.config.compile is not None:
            return self.config.compile
        # one process only: the compiled steps inside DistributedDataParallel are not measured on a GPU yet
        return self.data.device.type == "cuda" and not self.distributed and self.num_steps >= COMPILE_AUTO_STEPS

    def base_loss(self) -> TensorTrace_ELBO:
        """The non-flat ELBO of the run's methods: ``TensorTrace_ELBO``, or its compiled form ``JitTensorTrace_ELBO``
        when :attr:`compiled` (so that a flat method and its base are both compiled)."""
        return JitTensorTrace_ELBO() if self.compiled else TensorTrace_ELBO()

    def option(self, method: str, name: str, default: Any) -> Any:
        """A per-method hyperparameter from ``config.options[method][name]``, else ``default``; ``name`` must be one of
        the method's declared options (``register_method(..., options=...)``)."""
        if name not in METHODS[method].options:
            raise KeyError(f"method {method!r} reads option {name!r}, which its registration does not declare")
        return self.config.options.get(method, {}).get(name, default)

    def optim_spec(self, num_steps: int | None = None, *, mean_loss: bool = False) -> OptimSpec:
        """The run's optimizer (``config.optimizer``, ``lr``, ``momentum``, ``lr_schedule``) for a phase of
        ``num_steps`` (default ``num_steps``) steps. SGD's learning rate is ``lr / N`` on Pyro's full-data loss
        (:meth:`full_data_lr`), ``lr`` on a mean loss (``mean_loss=True``); Adam's is ``lr`` either way."""
        config = self.config
        if config.optimizer == "sgd":
            lr = config.lr if mean_loss else self.full_data_lr(config.lr)
            cls, args = torch.optim.SGD, {"lr": lr, "momentum": config.momentum}
        else:
            cls, args = torch.optim.Adam, {"lr": config.lr}
        steps = self.num_steps if num_steps is None else num_steps
        return OptimSpec(cls, args, CosineDecay(steps) if config.lr_schedule == "cosine" else None)

    def full_data_lr(self, lr: float) -> float:
        r"""The step :math:`\alpha/N` on a full-data loss (Pyro's :math:`-\log p(\theta, \mathcal D)`, a sum over
        the :math:`N` training examples, or an SG-MCMC potential) that equals the learning rate :math:`\alpha` =
        ``lr`` on the mean loss, as the papers quote it."""
        return lr / self.data.num_data

    def stream(self, phase: int, *, explicit: bool = False) -> TensorStream | LoaderStream:
        """The minibatch stream of training phase ``phase`` (see :mod:`pyro_flat.bench.loop`): ``explicit`` asks for
        the minibatch itself even for tensor data (``num_data=N`` instead of in-model subsampling)."""
        rank, world_size = world()
        if self.uses_loader:
            config = self.config
            return LoaderStream(self.data, self.batch_size, stream_seed(self.seed, phase),
                                num_workers=config.num_workers, channels_last=config.channels_last, rank=rank,
                                world_size=world_size, drop_last=self.distributed)
        return TensorStream(self.data, self.batch_size, explicit=explicit or self.distributed, rank=rank,
                            world_size=world_size)

    def loop(
        self,
        num_steps: int,
        state: Mapping[str, object],
        *,
        explicit: bool = False,
        prepare: Callable[..., object] | None = None,
        log_every: int = 50,
        name: str = "",
    ) -> TrainingLoop:
        """A checkpointed training phase of ``num_steps`` steps over this problem's minibatches (see
        :class:`~pyro_flat.bench.loop.TrainingLoop`); ``state`` names everything the phase changes."""
        return TrainingLoop(self.context, num_steps, state, lambda phase: self.stream(phase, explicit=explicit),
                            steps_per_epoch=self.steps_per_epoch, device=self.data.device, prepare=prepare,
                            log_every=log_every, name=name)

    def setup_args(self) -> tuple[tuple[Tensor, Tensor], dict[str, int]]:
        """The model's arguments to set a kernel up with: the whole training set with ``subsample_size=B`` for tensor
        data in one process (what ``MCMC.run`` passes), else :meth:`first_batch`."""
        if self.uses_loader or self.distributed:
            return self.first_batch()
        return (self.data.x_train, self.data.y_train), {"subsample_size": self.batch_size}

    def first_batch(self) -> tuple[tuple[Tensor, Tensor], dict[str, int]]:
        """A small fixed batch (this rank's shard size of the first examples, ``num_data=N``) to create a guide's
        parameters before training; draws no random number for the data."""
        shard = self.shard_size
        return (self.data.x_train[:shard], self.data.y_train[:shard]), {"num_data": self.data.num_data}

    def data_parallel(self, module: nn.Module) -> nn.Module:
        """``module`` wrapped in ``DistributedDataParallel`` when the run is data-parallel, else itself."""
        if not self.distributed:
            return module
        device = self.data.device
        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


@dataclass
class Posterior:
    """What a trained method leaves for prediction: a model and a way to draw latent values.

    :param model: the trained model.
    :param draw: ``draw(num_samples) -> iterator of {site: value}``.
    :param num_samples: draws averaged in the BMA (1 for a point estimate, M for an ensemble).
    :param mc_dropout: keep dropout active at prediction time.
    :param info: anything the method wants to report (training losses, ...).
    """

    model: BayesianClassifier
    draw: Callable[[int], Iterator[dict[str, Tensor]]]
    num_samples: int
    mc_dropout: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_guide(cls, model: BayesianClassifier, guide: Callable, num_samples: int, **kw: Any) -> Posterior:
        """Draws from a (trained) guide."""
        return cls(model, lambda n: guide_draws(guide, n), num_samples, **kw)

    @classmethod
    def from_points(cls, model: BayesianClassifier, points: Sequence[Mapping[str, Tensor]], **kw: Any) -> Posterior:
        """A point estimate (one dict) or an equally weighted set of points (ensemble members), cycled."""
        points = [{k: v.detach() for k, v in p.items()} for p in points]
        if not points:
            raise ValueError("`points` is empty")

        def draw(n: int) -> Iterator[dict[str, Tensor]]:
            for i in range(n):
                yield points[i % len(points)]

        kw.setdefault("num_samples", len(points))
        return cls(model, draw, **kw)

    @classmethod
    def from_samples(
        cls, model: BayesianClassifier, samples: Mapping[str, Tensor], num_samples: int, **kw: Any
    ) -> Posterior:
        """Stacked samples ``{site: [S, ...]}`` (e.g. from MCMC), thinned evenly to ``num_samples``."""
        total = next(iter(samples.values())).shape[0]
        return cls(model, lambda n: sample_draws(samples, min(n, total)), min(num_samples, total), **kw)


def run_svi(
    problem: Problem,
    model: BayesianClassifier,
    guide: Callable,
    loss: pyro.infer.ELBO | None = None,
    *,
    optim: OptimSpec | None = None,
    num_steps: int | None = None,
    callback: Callable[[int], None] | None = None,
    log_every: int = 50,
    state: Mapping[str, object] | None = None,
) -> list[float]:
    """Run ``num_steps`` (default ``problem.num_steps``) SVI steps as one checkpointed phase.

    In one process this is Pyro's ``SVI`` with a Pyro optimizer (tensor data: in-model minibatches); data-parallel,
    it is Pyro's ``ELBOModule`` in ``DistributedDataParallel`` (:func:`~pyro_flat.distributed.ddp_elbo`) with the same
    torch optimizer, each rank on its shard.

    :param loss: the ELBO (default :meth:`Problem.base_loss`; the flat ones with ``distributed=True`` when
        data-parallel).
    :param optim: the optimizer (default ``problem.optim_spec()``); a schedule is stepped after every step.
    :param callback: called as ``callback(step)`` after every step (e.g. to collect SWAG iterates).
    :param log_every: keep every ``log_every``-th loss value.
    :param state: further objects the callback changes (e.g. a SWAG collector), checkpointed with the phase.
    :returns: the kept loss values.
    :raises FloatingPointError: if the loss becomes NaN or infinite, naming the step.
    """
    loss = problem.base_loss() if loss is None else loss
    spec = problem.optim_spec(num_steps) if optim is None else optim
    num_steps = problem.num_steps if num_steps is None else num_steps
    extra = dict(state or {})
    if getattr(getattr(loss, "schedule", None), "active", False):  # LookSAM/RST: its schedule is part of the state
        extra["loss"] = loss
    model.train()
    if not problem.distributed:
        optimizer = spec.pyro()
        svi = TensorSVI(model, guide, optimizer, loss)  # the loss stays on the device: read every log_every steps
        loop = problem.loop(num_steps, {"model": model, "guide": guide, "optim": optimizer, **extra}, prepare=guide,
                            log_every=log_every, name="svi")
        for step, (args, kwargs) in loop:
            loop.record(svi.step(*args, **kwargs))
            if spec.lr_lambda is not None:
                optimizer.step()
            if callback is not None:
                callback(step)
        return loop.history
    args, kwargs = problem.first_batch()
    guide(*args, **kwargs)  # create the guide's parameters (the same on every rank: the ranks are seeded alike)
    module = ddp_elbo(model, guide, loss, **_ddp_kwargs(problem))
    optimizer, schedule = spec.torch(module.parameters())
    objects = {"model": model, "guide": guide, "optim": optimizer, **extra}
    if schedule is not None:
        objects["schedule"] = schedule
    loop = problem.loop(num_steps, objects, log_every=log_every, name="svi (DDP)")
    for step, (args, kwargs) in loop:
        optimizer.zero_grad()
        value = module(*args, **kwargs)
        value.backward()
        optimizer.step()
        loop.record(value.detach())
        if schedule is not None:
            schedule.step()
        if callback is not None:
            callback(step)
    return loop.history


def _ddp_kwargs(problem: Problem) -> dict[str, Any]:
    device = problem.data.device
    return {"device_ids": [device.index]} if device.type == "cuda" else {}


def to_device(data: ClassificationData, config: RunConfig) -> ClassificationData:
    """``data`` on the run's device and dtype."""
    return data.to(device=torch.device(config.device), dtype=config.torch_dtype)

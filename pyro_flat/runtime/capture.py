r"""Compiled evaluation of Pyro programs: a step of an objective or a kernel captured once as a pure tensor function.

A training step of a flat objective or a stochastic-gradient kernel runs Pyro's Python machinery (tracing, effect
handlers, a distribution object per site, two model passes for the flat methods) around a small amount of tensor
arithmetic. For a model whose structure is fixed for a given minibatch shape, that machinery computes the same thing
at every step, so it can run once: :func:`capture` runs the eager step and records it as a graph of tensor
operations (an FX graph of ATen operations, :func:`torch.fx.experimental.proxy_tensor.make_fx`), a pure function

.. math:: (\phi,\ \mathcal D,\ \xi) \mapsto \text{outputs}

of the tensors that change from step to step — the parameters :math:`\phi` (or latent values), the tensors among
the program's arguments :math:`\mathcal D` — and of the random numbers :math:`\xi` the step draws. Later steps
evaluate that function, optionally compiled by :func:`torch.compile`. Because the graph *is* the eager step, it
has exactly the eager semantics: the same subsample handling and :math:`N/B` scaling, the same observed sites, the
same second pass (replayed minibatch and random numbers, BatchNorm statistics frozen).

**Random numbers.** Every random draw of the step (a subsample's ``randperm``, a guide's base noise, a dropout mask,
a kernel's Langevin noise) is lifted out of the graph: it is drawn eagerly before each evaluation by the same
operation, in the same order, from the same generator, so the compiled step consumes torch's random stream exactly
as the eager one and, given the same seed, computes with the same numbers. A draw that the eager step *replays*
(it resets the generator to an earlier state, as the replay of a perturbed pass does) is the same input used twice.
This is checked when the step is captured: the lifted draws, repeated from the generator's state before the step,
must give the recorded values and leave the generator where the eager step left it.

**What cannot be captured** raises :class:`CaptureError` (the objectives and kernels then fall back to their eager
path with one :class:`CompilationFallbackWarning` saying why): a value computed from the inputs read on the host
(Python control flow on tensor values, e.g. ``if x.sum() > 0``, or ``.item()``), which would freeze one branch; a
random draw whose values depend on other tensors' values (e.g. a Gamma ``rsample`` with learned parameters) or that
uses its own ``torch.Generator``; random numbers the eager step draws and then discards; a graph that does not
reproduce the eager step when evaluated on the same inputs (checked once, at capture).

**What the graph keeps by reference**: tensors the step reads that are not inputs (module buffers, a prior's scale,
data held in a closure) are constants of the graph, referenced, not copied, so in-place updates (BatchNorm running
statistics) act on the model's own buffers. Replacing such a tensor (``module.to(...)``) requires a new capture; the
objectives and kernels key their captures on the modules' buffers and train/eval modes, the argument shapes, dtypes
and devices and the non-tensor arguments. Python side effects of the step other than tensor operations (counters,
prints) happen only at capture.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyro
import torch
from torch import Tensor
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from .._internals import OpOverload, TorchDispatchMode, op_schema, pytree
from .rng import cuda_devices, set_torch_random_state, torch_random_state

__all__ = ["CaptureError", "CapturedFunction", "CompilationFallbackWarning", "capture", "is_capturing"]

_SEEDED = torch.Tag.nondeterministic_seeded
_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_DETACH = torch.ops.aten.detach.default


class CompilationFallbackWarning(UserWarning):
    """A compiled objective or kernel runs its eager path instead (the message says why); its results are those of
    the eager path."""


class CaptureError(Exception):
    """A step that cannot be captured as a pure tensor function (the message says why)."""


_TRACING = [0]  # depth of traced runs under way (the second run of a capture)


def is_capturing() -> bool:
    """Whether the code runs as the traced run of a capture (:func:`capture`): a step whose Python-side decisions
    change from call to call (e.g. a schedule of sharpness-aware steps) raises :class:`CaptureError` there, unless
    the caller keys its captures on them."""
    return _TRACING[0] > 0


# -------------------------------------------------------------------------------------------------------------------
# random draws


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor argument of a random draw, kept by its metadata only (its values must not matter)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: Tensor) -> _TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def make(self, fill: bool = False) -> Tensor:
        """A tensor with this metadata, filled with NaN (zeros for integers) if ``fill``, else uninitialised."""
        out = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
        if fill:
            out.fill_(math.nan if self.dtype.is_floating_point or self.dtype.is_complex else 0)
        return out


_UNDECLARED_WRITES = {  # operations that update BatchNorm running statistics without declaring it in their schema
    torch.ops.aten.native_batch_norm.default: [3, 4],
    torch.ops.aten.cudnn_batch_norm.default: [3, 4],
    torch.ops.aten.miopen_batch_norm.default: [3, 4],
}


def _written_arguments(func: OpOverload) -> list[int | str]:
    """Positions (or names, for keyword-only ``out=``) of the arguments an operation writes to."""
    out: list[int | str] = list(_UNDECLARED_WRITES.get(func, ()))
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(arg.name if arg.kwarg_only else i)
    return out


def _get(args: tuple, kwargs: dict, where: int | str) -> Any:
    return kwargs[where] if isinstance(where, str) else args[where]


class _Draw:
    """One random draw of a captured step, repeated outside the graph before each evaluation: the same operation on
    tensors of the same metadata, from the same generator, gives the same numbers as in the eager step."""

    def __init__(self, func: OpOverload, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.written = _written_arguments(func)

        def spec(a: Any) -> Any:
            return _TensorSpec.of(a) if isinstance(a, Tensor) else a

        self.args = pytree.tree_map(spec, args)
        self.kwargs = pytree.tree_map(spec, kwargs)
        # where the tensors go, when they are top-level arguments (always, for torch's random operations)
        self._tensor_args = [(i, a) for i, a in enumerate(self.args) if isinstance(a, _TensorSpec)]
        self._tensor_kwargs = [(k, a) for k, a in self.kwargs.items() if isinstance(a, _TensorSpec)]
        flat = pytree.tree_leaves((self.args, self.kwargs))
        self._nested = sum(isinstance(a, _TensorSpec) for a in flat) != len(self._tensor_args) + len(
            self._tensor_kwargs)

    def signature(self) -> tuple:
        return (self.func, repr(self.args), repr(sorted(self.kwargs.items())))

    def value(self, args: tuple, kwargs: dict, result: Any) -> Tensor:
        """The random numbers of a call of the operation: the tensor it writes, its mask (``native_dropout``, whose
        output also depends on its input's values), or its result."""
        if self.written:
            return _get(args, kwargs, self.written[0])
        if self.func is _NATIVE_DROPOUT:
            return result[1]
        return result

    def __call__(self, fill: bool = False) -> Tensor:
        """Draw again: the operation on fresh tensors of the recorded metadata (NaN-filled with ``fill``)."""
        if self._nested:
            args, kwargs = pytree.tree_map(lambda a: a.make(fill) if isinstance(a, _TensorSpec) else a,
                                           (self.args, self.kwargs))
        else:
            args, kwargs = list(self.args), dict(self.kwargs)
            for i, a in self._tensor_args:
                args[i] = a.make(fill)
            for k, a in self._tensor_kwargs:
                kwargs[k] = a.make(fill)
            args = tuple(args)
        return self.value(args, kwargs, self.func(*args, **kwargs))

    def __repr__(self) -> str:
        return f"{self.func}"


def _state_key(state: tuple[Tensor, list[Tensor]]) -> tuple[bytes, ...]:
    cpu, cuda = state
    return (bytes(cpu.numpy()), *(bytes(s.numpy()) for s in cuda))


class _RecordDraws(TorchDispatchMode):
    """Around the eager step: records every random draw in order, recognising a draw made again from a generator
    state already seen (a replay) as the same draw. Never raises: what cannot be captured is kept in ``problems``."""

    def __init__(self, devices: list[int]) -> None:
        super().__init__()
        self.devices = devices
        self.draws: list[_Draw] = []
        self.values: list[Tensor] = []
        self.calls: list[int] = []
        self.problems: list[str] = []
        self._seen: dict[tuple, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        if kwargs.get("generator") is not None:
            self.problems.append(f"the random operation {func} uses its own torch.Generator")
        state = _state_key(torch_random_state(self.devices))
        result = func(*args, **kwargs)
        draw = _Draw(func, args, kwargs)
        value = draw.value(args, kwargs, result)
        key = (draw.signature(), state)
        index = self._seen.get(key)
        if index is None:
            index = len(self.draws)
            self._seen[key] = index
            self.draws.append(draw)
            self.values.append(value.detach().clone())
        elif not _equal(self.values[index], value):
            self.problems.append(
                f"the random operation {func} gave different numbers from the same generator state: its numbers depend "
                "on the values of its tensor arguments (e.g. a Gamma rsample with learned parameters), which cannot be "
                "drawn outside the graph"
            )
        self.calls.append(index)
        return result


def _equal(a: Tensor, b: Tensor) -> bool:
    """``torch.equal``, but for tensors on the ``meta`` device (no values: a capture there checks devices, shapes and
    dtypes, what a test of where tensors live needs)."""
    return a.is_meta or torch.equal(a, b)


def _check_draws(record: _RecordDraws, start: tuple, end: tuple) -> None:
    """The lifted draws, repeated from the generator state before the step, give the recorded numbers and leave the
    generator where the eager step left it."""
    if record.problems:
        raise CaptureError(record.problems[0])
    set_torch_random_state(start, record.devices)
    try:
        for draw, value in zip(record.draws, record.values, strict=True):
            again = draw(fill=True)
            if again.shape != value.shape or not _equal(again, value):
                raise CaptureError(
                    f"the random operation {draw.func}, repeated from the generator's state before the step, does not "
                    "give the step's numbers: its numbers depend on the values of its tensor arguments (e.g. a Gamma "
                    "or Dirichlet rsample, a Bernoulli with tensor probabilities), which cannot be drawn outside the "
                    "graph, or the step reseeds the generator (torch.manual_seed)"
                )
        if _state_key(torch_random_state(record.devices)) != _state_key(end):
            raise CaptureError(
                "the step discards random numbers it draws or moves the random generator by other means than random "
                "operations (e.g. torch.manual_seed inside the model), so the compiled step could not consume the "
                "random stream as the eager step does"
            )
    finally:
        set_torch_random_state(end, record.devices)


# -------------------------------------------------------------------------------------------------------------------
# the traced run


class _TraceStep(TorchDispatchMode):
    """Around the traced (second) run of the step, inside ``make_fx``:

    * feeds the recorded draws (the graph's noise inputs) in place of random operations;
    * detaches the results of operations run with gradients disabled (the backward pass of an inner
      ``torch.autograd.grad``, ``torch.no_grad()`` blocks) that read a tensor requiring a gradient, so that
      differentiating the graph later cuts the gradient where the eager step did. Only those: ``aten.detach`` is a
      view, and a backward that writes into a strided view of a fresh buffer (``as_strided`` then ``copy_``, the
      backward of a channels-last ``AdaptiveAvgPool2d``) would otherwise become a view chain that torch.compile
      refuses to functionalize;
    * keeps a copy of every pre-existing tensor written in place (BatchNorm statistics), restored after the run: the
      eager step already applied its side effects;
    * notes where host reads (``.item()``, ``bool(tensor)``) happen, for the error message.
    """

    def __init__(self, record: _RecordDraws, inputs: Sequence[Tensor], noise: Sequence[Tensor]) -> None:
        super().__init__()
        self.record = record
        self.noise = noise
        self.position = 0
        self.created: dict[int, weakref.ref] = {}
        self.dependent: dict[int, weakref.ref] = {id(t): weakref.ref(t) for t in (*inputs, *noise)}
        self.saved: dict[int, tuple[Tensor, Tensor]] = {}
        self.host_reads: list[str] = []
        self.precision = torch.finfo(torch.float64).eps  # of the least precise floating result of the step

    @staticmethod
    def _member(table: dict[int, weakref.ref], t: Tensor) -> bool:
        ref = table.get(id(t))
        return ref is not None and ref() is t

    def depends(self, t: Tensor) -> bool:
        """Whether ``t`` was computed from the inputs or the random numbers."""
        return self._member(self.dependent, t) or (t._base is not None and self._member(self.dependent, t._base))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _SEEDED in func.tags:
            return self._feed(func, args, kwargs)
        written = _written_arguments(func)
        for where in written:
            self._save(_get(args, kwargs, where))
        if _returns_host_value(func):
            try:
                result = func(*args, **kwargs)
            except RuntimeError as error:  # make_fx refuses to read a value computed from the inputs
                raise CaptureError(_host_read_message(_user_frame())) from error
            self.host_reads.append(_user_frame())
            return result
        read = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and not self._is_created(t)]
        versions = [t._version for t in read]
        result = func(*args, **kwargs)
        for t, version in zip(read, versions, strict=True):
            if t._version != version and id(t if t._base is None else t._base) not in self.saved:
                raise CaptureError(f"the operation {func} modifies a tensor in place without declaring it")
        if not torch.is_grad_enabled() and not written and _reads_a_gradient_path(args, kwargs):
            result = pytree.tree_map(_cut_gradient, result)
        dependent = any(self.depends(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor))
        for r in pytree.tree_leaves(result):
            if isinstance(r, Tensor):
                self.created[id(r)] = weakref.ref(r)
                if dependent:
                    self.dependent[id(r)] = weakref.ref(r)
                if r.is_floating_point():
                    self.precision = max(self.precision, torch.finfo(r.dtype).eps)
        return result

    def _feed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        result = self._fed(func, args, kwargs)
        for r in pytree.tree_leaves(result):
            if isinstance(r, Tensor):
                self.dependent[id(r)] = weakref.ref(r)
        return result

    def _fed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.position >= len(self.record.calls):
            raise CaptureError(f"the traced run draws more random numbers than the eager step ({func})")
        index = self.record.calls[self.position]
        self.position += 1
        draw = self.record.draws[index]
        if draw.func is not func:
            raise CaptureError(f"the traced run draws with {func} where the eager step drew with {draw.func}")
        noise = self.noise[index]
        if draw.written:
            target = _get(args, kwargs, draw.written[0])
            self._save(target)
            return target.copy_(noise)
        if func is _NATIVE_DROPOUT:  # its output depends on its input: only the mask is drawn outside the graph
            x, p = args[0], args[1]
            train = args[2] if len(args) > 2 else kwargs.get("train", True)
            scale = 1.0 if train is False else (1.0 / (1.0 - p) if p < 1 else 0.0)
            return x * noise * scale, noise.clone()
        return noise.clone()

    def _is_created(self, t: Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) was made by the traced run (not a constant or an input)."""
        return self._member(self.created, t if t._base is None else t._base)

    def _save(self, t: Tensor | None) -> None:
        if t is None:
            return
        base = t if t._base is None else t._base
        if self._is_created(base) or id(base) in self.saved:
            return
        self.saved[id(base)] = (base, base.detach().clone())

    def restore(self) -> None:
        for base, copy in self.saved.values():
            _restore(base, copy)


def _reads_a_gradient_path(args: tuple, kwargs: dict) -> bool:
    """Whether an operation reads a tensor that requires a gradient. Run with gradients disabled, only such an
    operation has a result that the graph, differentiated later, would connect to the inputs where the eager step did
    not: the result of an operation of tensors that require no gradient carries none in the graph either."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs)))


def _cut_gradient(result: Any) -> Any:
    """``aten.detach`` of a floating result (integer and boolean results carry no gradient)."""
    if isinstance(result, Tensor) and (result.is_floating_point() or result.is_complex()):
        return _DETACH(result)
    return result


def _restore(tensor: Tensor, value: Tensor) -> None:
    """Write ``value`` back into ``tensor`` (a BatchNorm statistic the traced or replayed run updated) without
    bumping its version counter: the eager step's autograd graph saved the tensor (BatchNorm's backward keeps its
    running statistics) and must stay valid for its backward pass; the values are the eager step's own."""
    tensor.data.copy_(value)


class _HostCopies(TorchFunctionMode):
    """Around the traced run: a copy to Python or NumPy (``tolist``, ``numpy``) of a value computed from the inputs
    is a host read the dispatcher does not see."""

    _COPIES = (Tensor.tolist, Tensor.numpy, Tensor.__array__)

    def __init__(self, step: _TraceStep) -> None:
        super().__init__()
        self.step = step

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in self._COPIES and args and isinstance(args[0], Tensor) and self.step.depends(args[0]):
            raise CaptureError(_host_read_message(_user_frame()))
        return func(*args, **(kwargs or {}))


def _returns_host_value(func: OpOverload) -> bool:
    """Whether an operation returns Python values (``_local_scalar_dense`` behind ``.item()`` and ``bool()``,
    ``equal``, ...) rather than tensors."""
    returns = op_schema(func).returns
    return bool(returns) and not any("Tensor" in str(r.type) for r in returns)


def _host_read_message(where: str) -> str:
    return (f"a value computed from the parameters, latent values, data or random numbers is read on the host at "
            f"{where}: Python control flow on tensor values (or .item()) cannot be captured, the graph would freeze "
            "one branch")


def _user_frame() -> str:
    """The innermost stack frame outside torch and this module (where a host read happens)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("pyro_flat/runtime/capture.py"):
            return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return "an unknown place"


def _custom_functions(outputs: list[Any]) -> list[str]:
    """The custom ``torch.autograd.Function`` s in the autograd graph of ``outputs``, by name."""
    stack = [t.grad_fn for t in outputs if isinstance(t, Tensor) and t.grad_fn is not None]
    seen, names = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            names.append(type(node).__name__.removesuffix("Backward"))
        stack.extend(parent for parent, _ in node.next_functions)
    return names


def _check_graph(graph: GraphModule, host_reads: list[str]) -> None:
    """No host read of a value computed from the inputs, no random operation left in the graph."""
    dependent: set[torch.fx.Node] = set()
    reads = iter(host_reads)
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            dependent.add(node)
            continue
        if node.op != "call_function":
            continue
        if any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
        target = node.target
        if isinstance(target, OpOverload):
            if _returns_host_value(target):
                where = next(reads, "an unknown place")
                if node in dependent:
                    raise CaptureError(_host_read_message(where))
            if _SEEDED in target.tags:
                raise CaptureError(f"the random operation {target} could not be lifted out of the graph")


# -------------------------------------------------------------------------------------------------------------------
# the captured function


class CapturedFunction:
    """A step captured by :func:`capture`: ``f(inputs) -> outputs`` (the pytree the step returned), drawing its
    random numbers as the eager step does, evaluated as a graph or through :func:`torch.compile`.

    :ivar graph: the FX graph (inputs: the tensors given to :func:`capture`, then the draws).
    :ivar float capture_seconds: wall time of the capture (the traced run and the checks).
    :ivar compile_seconds: wall time of the first compiled evaluation (compilation included), or ``None``.
    """

    def __init__(
        self, graph: GraphModule, draws: list[_Draw], out_spec: pytree.TreeSpec, mutated: list[Tensor],
        capture_seconds: float,
    ) -> None:
        self.graph = graph
        self.draws = draws
        self.out_spec = out_spec
        self.mutated = mutated
        self.capture_seconds = capture_seconds
        self.devices: set[str] = set()  # the device types of the inputs
        self.compile_seconds: float | None = None
        self.cuda_graphs = False  # whether the compiled step replays CUDA graphs
        self._run: Callable = graph
        self._compiling = False

    def draw(self) -> list[Tensor]:
        """This evaluation's random numbers, drawn as the eager step draws them."""
        return [draw() for draw in self.draws]

    def compile(self, options: Mapping[str, Any]) -> None:
        """Evaluate through ``torch.compile(graph, dynamic=False, **options)`` from now on; the compilation happens at
        the next call, whose wall time is kept in :attr:`compile_seconds`. The graph is one FX graph of ATen
        operations, which torch.compile takes in one piece; ``fullgraph=True`` is not set because torch 2.11 then also
        refuses the generator frames that run *during* a compiled call (e.g. a logging handler's), which are not part
        of the graph.

        Defaults by device, unless ``options`` set a ``mode`` or inductor ``options``: on CUDA,
        ``mode="reduce-overhead"``, so that a step replays a CUDA graph (one launch for the step's kernels; the
        outputs are then copied out of the graph's memory, which the next replay reuses); on CPU, TorchInductor's
        layout optimisation (channels-last convolutions) is off: the weights of a Bayesian network are new tensors at
        every step, and converting them costs more than it saves (ResNet-18, ``docs/speed.md``)."""
        options = {"dynamic": False, **options}
        inductor = options.get("backend", "inductor") == "inductor"
        default = inductor and "options" not in options and "mode" not in options
        if default and self.devices == {"cuda"}:
            options["mode"] = "reduce-overhead"
        elif default and self.devices == {"cpu"}:
            options["options"] = {"layout_optimization": False}
        self.cuda_graphs = options.get("mode") in ("reduce-overhead", "max-autotune")
        self._run = torch.compile(self.graph, **options)
        self._compiling = True

    @property
    def compiling(self) -> bool:
        """Whether the next call compiles."""
        return self._compiling

    def uncompile(self) -> None:
        """Evaluate the graph as it is (e.g. after a compilation failure)."""
        self._run = self.graph
        self._compiling = False
        self.cuda_graphs = False
        self.compile_seconds = None

    def __call__(self, inputs: Sequence[Tensor], noise: Sequence[Tensor] | None = None) -> Any:
        noise = self.draw() if noise is None else noise
        if self.cuda_graphs:  # a new step: the previous replay's outputs were copied out (below)
            torch.compiler.cudagraph_mark_step_begin()
        if self._compiling:
            start = time.perf_counter()
            flat = self._run(*inputs, *noise)
            self.compile_seconds = time.perf_counter() - start
            self._compiling = False
        else:
            flat = self._run(*inputs, *noise)
        if self.cuda_graphs:  # the graph's output memory is overwritten by its next replay: the caller keeps copies
            flat = [t.clone() if isinstance(t, Tensor) else t for t in flat]
        return pytree.tree_unflatten(list(flat), self.out_spec)


def _same(eager: Any, replayed: Any, precision: float) -> bool:
    """Whether the graph's outputs are the eager step's up to floating-point rounding: relative differences of
    ``1e-5``, or of 4 units of ``precision`` (the machine epsilon of the least precise floating result of the step,
    ``2**-7`` under bf16 autocast) if larger. A GPU's kernels may sum in another order from one call to the next
    (atomics, cuDNN's choice of algorithm), so an exact match is not expected."""
    rtol = max(1e-5, 4 * precision)
    for a, b in zip(pytree.tree_leaves(eager), pytree.tree_leaves(replayed), strict=True):
        if isinstance(a, Tensor):
            a, b = a.detach(), b.detach()
            if a.shape != b.shape:
                return False
            if a.is_meta:
                continue
            scale = float(a.abs().max()) if a.numel() else 0.0
            if not torch.allclose(a, b, rtol=rtol, atol=rtol / 10 * (1 + scale), equal_nan=True):
                return False
    return True


def capture(
    fn: Callable[[], Any], inputs: Callable[[], Sequence[Tensor]]
) -> tuple[Any, CapturedFunction | CaptureError]:
    """Run the step ``fn()`` eagerly and capture it as a pure function of ``inputs()`` and of its random draws.

    :param fn: the step, a function of nothing returning a pytree of tensors; it reads the input tensors (the very
        objects) wherever it likes (as the model's arguments, through ``pyro.param``, ...).
    :param inputs: returns the tensors that change from call to call (parameters, latent values, data), in the order
        the captured function takes them; called after the eager run (which may create them).
    :returns: ``(outputs, captured)``: the eager step's outputs (the step was run exactly once, side effects
        included) and the :class:`CapturedFunction`, or the :class:`CaptureError` saying why it cannot be captured.
        Exceptions raised by the step itself propagate.
    """
    devices = cuda_devices()
    start_state = torch_random_state(devices)
    with _RecordDraws(devices) as record:
        outputs = fn()
    end_state = torch_random_state(devices)
    started = time.perf_counter()
    try:
        _check_draws(record, start_state, end_state)
        tensors = list(inputs())
        if len({id(t) for t in tensors}) != len(tensors):
            raise CaptureError("the same tensor is given twice as an input")
        captured = _trace(fn, tensors, record, outputs, started)
    except CaptureError as error:
        return outputs, error
    finally:
        set_torch_random_state(end_state, devices)
    return outputs, captured


def _trace(fn: Callable[[], Any], inputs: list[Tensor], record: _RecordDraws, outputs: Any,
           started: float) -> CapturedFunction:
    """The traced run of the step under ``make_fx``, checked, and the captured function checked against the eager
    step's outputs."""
    noise = [v.clone() for v in record.values]
    out_spec: list[pytree.TreeSpec] = []
    step = _TraceStep(record, inputs, noise)

    def traced(*tensors: Tensor) -> list[Tensor]:
        with step, _HostCopies(step):
            flat, spec = pytree.tree_flatten(fn())
        custom = _custom_functions(flat)
        if custom:
            raise CaptureError(
                f"the step's outputs are differentiated through the custom autograd.Function {custom[0]}, whose "
                "backward a graph of tensor operations cannot keep (it would be differentiated as its forward "
                "operations, which run without gradients); register it as a torch.library.custom_op with "
                "register_autograd to compile it"
            )
        out_spec.append(spec)
        return [t for t in flat]

    _TRACING[0] += 1
    try:
        with pyro.validation_enabled(False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = make_fx(traced, decomposition_table={}, record_stack_traces=False)(*inputs, *noise)
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 (any failure of the tracer means: run eagerly)
        raise CaptureError(f"tracing the step failed ({type(error).__name__}: {str(error).splitlines()[0]})") from error
    finally:
        _TRACING[0] -= 1
        step.restore()
    if step.position != len(record.calls):
        raise CaptureError("the traced run draws fewer random numbers than the eager step")
    _check_graph(graph, step.host_reads)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    mutated = [base for base, _ in step.saved.values()]
    captured = CapturedFunction(graph, record.draws, out_spec[0], mutated, time.perf_counter() - started)
    captured.devices = {t.device.type for t in (*inputs, *noise)}
    # the graph must reproduce the eager step on the same inputs and random numbers (side effects undone after)
    copies = [t.detach().clone() for t in mutated]
    try:
        with torch.no_grad():
            replayed = captured(inputs, [v.clone() for v in record.values])
    finally:
        for t, c in zip(mutated, copies, strict=True):
            _restore(t, c)
    if not _same(outputs, replayed, step.precision):
        raise CaptureError("the captured graph does not reproduce the eager step (the program is not a pure function "
                           "of its tensor inputs)")
    captured.capture_seconds = time.perf_counter() - started
    return captured

"""pyro_flat._internals, the one door to Pyro's and torch's private APIs: nothing else in the package reaches them,
and each name it defines still does what pyro_flat relies on with the installed Pyro and torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDiagonalNormal
from pyro.poutine.block_messenger import BlockMessenger
from torch import nn

from pyro_flat import _internals

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_flat"

PRIVATE_NAMES = {"_PYRO_STACK", "_params", "_BatchNorm", "_InstanceNorm", "_schema", "_state_waiting_to_be_consumed",
                 "_get_loc_and_scale", "_unpack_latent", "_ops", "_pytree", "_python_dispatch", "_deterministic",
                 "hide_fn", "unconstrained", "_flat_weights", "_flat_weights_names"}
"""The private names of Pyro and torch pyro_flat uses (the attribute ``unconstrained`` is set by ``pyro.param``)."""


def private_uses(path: Path) -> list[str]:
    """``line: what`` for every private Pyro or torch name a file reaches: an import from a private module or of a
    private name, an attribute of :data:`PRIVATE_NAMES` (not of ``self``, read or set by name too), or a private one
    as a string key. torch's
    ``torch._foreach_*`` list operations (those torch's own optimizers use) are not counted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("pyro", "torch"):
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                    alias.name.startswith("_") for alias in node.names):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES and node.value.startswith("_"):
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr") \
                and len(node.args) > 1 and getattr(node.args[1], "value", None) in PRIVATE_NAMES:
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_but_the_door_reaches_a_private_api():
    found = {str(path.relative_to(PACKAGE.parent)): uses for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "_internals.py" and (uses := private_uses(path))}
    assert found == {}, found


def test_the_scan_sees_private_uses():
    assert private_uses(PACKAGE / "_internals.py")  # the door itself is full of them


def test_every_name_of_the_door_is_used_and_explained():
    """Each name is used somewhere, and says which public API is missing: a function in its docstring, an alias in
    the string that follows it, an imported name in a comment."""
    source = (PACKAGE / "_internals.py").read_text()
    body = ast.parse(source).body
    explained = {stmt.name for stmt in body if isinstance(stmt, ast.FunctionDef) and ast.get_docstring(stmt)}
    for stmt, after in zip(body, body[1:], strict=False):
        if isinstance(stmt, ast.Assign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            explained |= {target.id for target in stmt.targets}
    comments = [line for line in source.splitlines() if line.lstrip().startswith("#")]
    explained |= {name for name in _internals.__all__ if any(name.lower() in line.lower() for line in comments)}
    assert explained >= set(_internals.__all__), set(_internals.__all__) - explained
    rest = "".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "_internals.py")
    assert all(name in rest for name in _internals.__all__), [n for n in _internals.__all__ if n not in rest]


def test_torch_internals_still_mean_what_they_meant():
    for layer in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm1d()):
        assert isinstance(layer, _internals.BatchNormBase) and hasattr(layer, "running_mean")
    assert isinstance(nn.InstanceNorm2d(2), _internals.InstanceNormBase)
    lstm = nn.LSTM(2, 3, num_layers=2)
    names = _internals.rnn_weight_names(lstm)
    assert names[:4] == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"] and len(names) == 8
    assert [w is getattr(lstm, n) for w, n in zip(getattr(lstm, _internals.RNN_FLAT_WEIGHTS), names, strict=True)] == [
        True] * 8
    assert not isinstance(nn.GroupNorm(1, 2), (_internals.BatchNormBase, _internals.InstanceNormBase))
    schema = _internals.op_schema(torch.ops.aten.add_.Tensor)
    assert isinstance(torch.ops.aten.add_.Tensor, _internals.OpOverload)
    assert [a.name for a in schema.arguments][:2] == ["self", "other"] and schema.arguments[0].alias_info.is_write
    leaves, spec = _internals.pytree.tree_flatten({"a": [torch.ones(1), 2]})
    assert len(leaves) == 2 and _internals.pytree.tree_unflatten(leaves, spec)["a"][1] == 2
    assert issubclass(_internals.TorchDispatchMode, torch.overrides.TorchFunctionMode.__mro__[-1])


def test_pyro_internals_still_mean_what_they_meant():
    pyro.clear_param_store()
    assert _internals.handler_stack() == []
    with poutine.trace() as tracer:
        assert _internals.handler_stack()[-1] is tracer
    block = BlockMessenger(hide=["a"])
    assert _internals.blocks(block, {"name": "a", "type": "sample", "is_observed": False})
    assert not _internals.blocks(block, {"name": "b", "type": "sample", "is_observed": False})

    scale = pyro.param("scale", torch.ones(2), constraint=dist.constraints.positive)
    store = _internals.unconstrained_params()
    assert torch.equal(store["scale"], torch.zeros(2)) and scale.unconstrained() is store["scale"]
    other = torch.ones(2)
    _internals.set_unconstrained(other, store["scale"])
    assert other.unconstrained() is store["scale"] and _internals.unconstrained_of(other) is store["scale"]
    assert _internals.unconstrained_of(torch.ones(1)) is None

    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.deterministic("y", 2 * x)

    trace = poutine.trace(model).get_trace()
    assert _internals.is_deterministic_record(trace.nodes["y"]) and not _internals.is_deterministic_record(
        trace.nodes["x"])

    optim = pyro.optim.Adam({"lr": 0.1})
    optim.set_state({"scale": {"state": {}, "param_groups": []}})
    assert _internals.optimizer_states_not_consumed(optim) == {"scale": {"state": {}, "param_groups": []}}

    def two_sites():
        pyro.sample("a", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("b", dist.Normal(0.0, 1.0))

    guide = AutoDiagonalNormal(two_sites, init_scale=0.5)
    guide()
    parts = _internals.autocontinuous_loc_scale(guide)
    assert [(name, tuple(loc.shape)) for name, loc, _ in parts] == [("a", (2,)), ("b", ())]
    assert all(torch.allclose(scale, torch.full_like(scale, 0.5)) for _, _, scale in parts)
    guide_trace = poutine.trace(guide).get_trace()
    model_trace = poutine.trace(poutine.replay(two_sites, trace=guide_trace)).get_trace()
    model_trace.compute_log_prob()
    guide_trace.compute_score_parts()
    log_r = _internals.trace_log_r(model_trace, guide_trace).sum_to(frozenset())  # log p - log q over model sites
    log_q = sum(guide_trace.nodes[name]["log_prob"].sum() for name in ("a", "b"))
    assert torch.allclose(log_r, model_trace.log_prob_sum() - log_q)
    with pytest.raises(NotImplementedError):
        _internals.autocontinuous_loc_scale(pyro.infer.autoguide.AutoIAFNormal(two_sites))
    pyro.clear_param_store()

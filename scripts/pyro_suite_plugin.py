"""A pytest plugin for ``scripts/pyro_suite.py``: swaps one of pyro_flat's objectives in for Pyro's ``Trace_ELBO``
(or ``TraceMeanField_ELBO``) before Pyro's test modules import it, and records every swapped test's outcome.

Configured by the environment: ``PYRO_FLAT_SUITE_OBJECTIVE`` (``sa``, ``sa_mf``, ``kl_fisher``, ``kl_score``),
``PYRO_FLAT_SUITE_RADIUS`` (``rho`` or ``radius``) and ``PYRO_FLAT_SUITE_OUT`` (where the JSON records go).
"""

from __future__ import annotations

import json
import os

import pyro.infer

import pyro_flat.infer as flat  # imported before the swap: its classes subclass Pyro's originals

SWAPPED = "FlatObjective"
_RECORDS: list[dict] = []


def _objective() -> tuple[str, type]:
    kind = os.environ["PYRO_FLAT_SUITE_OBJECTIVE"]
    radius = float(os.environ["PYRO_FLAT_SUITE_RADIUS"])
    base, options = {
        "sa": (flat.SharpnessAwareELBO, {}),
        "sa_mf": (flat.SharpnessAwareMeanFieldELBO, {}),
        "kl_fisher": (flat.KLBallELBO, {}),
        "kl_score": (flat.KLBallELBO, {"direction": "normalized_score"}),
    }[kind]

    def __init__(self, *args, **kwargs):  # Pyro's tests pass Trace_ELBO's options only
        base.__init__(self, radius, *args, **options, **kwargs)

    return ("TraceMeanField_ELBO" if kind == "sa_mf" else "Trace_ELBO"), type(SWAPPED, (base,), {"__init__": __init__})


def pytest_configure(config) -> None:
    name, objective = _objective()
    setattr(pyro.infer, name, objective)
    # many of Pyro's structural tests observe nothing: there the flat objective is the base one and says so once,
    # which Pyro's "filterwarnings = error" would turn into a failure of a test that checks something else
    config.addinivalue_line("filterwarnings", "ignore::pyro_flat.infer.NothingToPerturbWarning")


def _classify(report) -> tuple[str, str]:
    """``(outcome, message)`` of a swapped test: pass; refused (a ValueError/NotImplementedError raised by pyro_flat
    itself); differs (at a positive radius, a gradient test of ``test_gradient.py`` whose assertion compares with the
    hand-derived ``Trace_ELBO`` gradient: the flat objectives change that gradient on purpose); fail (anything else)."""
    if report.passed:
        return "pass", ""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    location = crash.path if crash is not None else ""
    ours = "pyro_flat" in location
    if ours and message.startswith(("ValueError", "NotImplementedError")):
        return "refused", message
    radius = float(os.environ["PYRO_FLAT_SUITE_RADIUS"])
    if radius > 0 and "test_gradient.py" in report.nodeid and message.startswith("AssertionError"):
        return "differs", message
    return "fail", message


def pytest_runtest_logreport(report) -> None:
    if SWAPPED not in report.nodeid or report.when != "call" and not report.failed:
        return
    if report.skipped:
        outcome, message = "skipped", ""
    else:
        outcome, message = _classify(report)
    _RECORDS.append({"test": report.nodeid, "outcome": outcome, "message": message[:400]})


def pytest_sessionfinish(session) -> None:
    if not hasattr(session.config, "workerinput"):
        with open(os.environ["PYRO_FLAT_SUITE_OUT"], "w") as f:
            json.dump(_RECORDS, f, indent=1)

"""Recording of the conformance outcomes: every conformance test marks the (method, case) it checks and, when it
checks a refusal, that the refusal was clear. With ``PYRO_FLAT_CONFORMANCE_OUT=<file>`` set, the session writes
``[{method, case, check, outcome}]`` there (outcome: ``pass``, ``refused`` or ``fail``);
``scripts/conformance_table.py`` renders it as the "what works with what" table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_RECORDS: list[dict] = []


class Outcome:
    """What a conformance test records: ``outcome.check(method, case, check)`` first, ``outcome.refused()`` after
    asserting a clear refusal."""

    def __init__(self, node: pytest.Item) -> None:
        self.node = node

    def check(self, method: str, case: str, check: str) -> None:
        self.node.user_properties.append(("conformance", [method, case, check]))

    def refused(self) -> None:
        self.node.user_properties.append(("conformance_refused", True))


@pytest.fixture
def outcome(request: pytest.FixtureRequest) -> Outcome:
    return Outcome(request.node)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    if "conformance" not in properties or report.when != "call" and not report.failed:
        return
    method, case, check = properties["conformance"]
    if report.failed:
        result = "fail"
    elif report.skipped:
        return
    else:
        result = "refused" if properties.get("conformance_refused") else "pass"
    _RECORDS.append({"method": method, "case": case, "check": check, "outcome": result})


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("PYRO_FLAT_CONFORMANCE_OUT")
    if out and _RECORDS and not hasattr(session.config, "workerinput"):  # the controller of pytest-xdist writes
        records = sorted(_RECORDS, key=lambda r: (r["method"], r["case"], r["check"]))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(records, indent=1) + "\n")

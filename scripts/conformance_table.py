"""The "what works with what" table, generated from the conformance suite's outcomes (never written by hand).

Runs ``pytest tests/conformance`` with ``PYRO_FLAT_CONFORMANCE_OUT`` set (the suite then records, for every method,
catalogue case and check, whether it passed, was refused with a clear error, or failed), writes the records to
``results/conformance/outcomes.json`` and the documentation page ``docs/conformance.md``: the summary (model features
in rows) and the detail (catalogue cases in rows), with one column per group of methods that share every outcome (so
the tables stay narrow), and Pyro's own suite (``results/conformance/pyro_suite.md``, from ``scripts/pyro_suite.py``).
A README that carries the ``conformance`` markers gets the summary too.

Run: ``python scripts/conformance_table.py`` (``--no-run`` renders the committed outcomes again).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ROOT / "results" / "conformance" / "outcomes.json"
PAGE = ROOT / "docs" / "conformance.md"
README = ROOT / "README.md"
START, END = "<!-- conformance:start -->", "<!-- conformance:end -->"
PYRO_SUITE = ROOT / "results" / "conformance" / "pyro_suite.md"
SYMBOL = {"pass": "✓", "refused": "R", "fail": "✗"}
KEY = ("✓: every check passes on every case; R: refused — the method stops with an error naming the site and the "
       "reason (e.g. discrete latents; SG-MCMC on local latents of a subsampled plate); ✓/R: some cases pass, some are "
       "refused; ✗: a check failed; –: no case.")


def run_suite() -> None:
    env = {**os.environ, "PYRO_FLAT_CONFORMANCE_OUT": str(OUTCOMES), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "conformance"), "-q", "-n", "2"]
    subprocess.run(command, cwd=ROOT, env=env, check=False)


def _cell(outcomes: set[str]) -> str:
    if not outcomes:
        return "–"
    if "fail" in outcomes:
        return "✗"
    return "/".join(SYMBOL[o] for o in ("pass", "refused") if o in outcomes)


def _catalogue() -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """The features of each catalogue case, and the description of each feature."""
    sys.path.insert(0, str(ROOT))
    from tests.conformance.catalogue import CASES, FEATURES, NETWORK_CASES

    return {case.name: case.features for case in [*CASES, *NETWORK_CASES]}, FEATURES


def _cells(records: list[dict], key: str) -> dict[tuple[str, str], set[str]]:
    """``{(method, case): outcomes}`` for ``key="case"``, ``{(method, feature): outcomes}`` for ``key="feature"``."""
    features, _ = _catalogue()
    cells: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in records:
        for row in (features.get(r["case"], ()) if key == "feature" else (r["case"],)):
            cells[r["method"], row].add(r["outcome"])
    return cells


def groups(records: list[dict]) -> list[list[str]]:
    """The methods, grouped by identical outcomes on every catalogue case (one column of the tables each)."""
    cells = _cells(records, "case")
    cases = sorted({r["case"] for r in records})
    by_outcomes: dict[tuple, list[str]] = defaultdict(list)
    for m in sorted({r["method"] for r in records}):
        by_outcomes[tuple(tuple(sorted(cells[m, c])) for c in cases)].append(m)
    return list(by_outcomes.values())


def _label(index: int) -> str:
    return chr(ord("A") + index)


def _table(records: list[dict], key: str, rows: list[tuple[str, str]]) -> list[str]:
    """Rows ``(row key, label)`` x method groups (columns A, B, ...; groups with no entry in any row left out)."""
    cells = _cells(records, key)
    columns = [(i, group) for i, group in enumerate(groups(records))
               if any(cells.get((group[0], row)) for row, _ in rows)]
    rows = [(row, label) for row, label in rows if any(cells.get((group[0], row)) for _, group in columns)]
    lines = [f"| {key} | " + " | ".join(_label(i) for i, _ in columns) + " |", "|---|" + ":-:|" * len(columns)]
    for row, label in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(cells[group[0], row]) for _, group in columns) + " |")
    return lines


def method_key(records: list[dict]) -> str:
    """Which methods each column letter stands for."""
    return "\n".join(f"* **{_label(i)}**: " + ", ".join(group) for i, group in enumerate(groups(records)))


def summary(records: list[dict]) -> str:
    """Model features (rows) x method groups (columns): ✓ (every check passes on every case with the feature), R
    (refused with a clear error naming the site), ✓/R (some cases of the feature are refused), ✗ (a check failed),
    – (no case)."""
    features, descriptions = _catalogue()
    lines = _table(records, "feature", list(descriptions.items()))
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        counts[r["outcome"]] += 1
    lines += ["", f"{len(records)} checks on {len(features)} catalogue cases: {counts['pass']} pass, "
              f"{counts['refused']} clear refusals, {counts['fail']} failures. {KEY} Generated by "
              "`python scripts/conformance_table.py` from `tests/conformance/`."]
    return "\n".join(lines)


def detail(records: list[dict]) -> str:
    """Catalogue cases (rows) x method groups (columns), the checks of each method and any failure."""
    cases = sorted({r["case"] for r in records})
    lines = _table(records, "case", [(c, c) for c in cases])
    checks = sorted({(r["method"], r["check"]) for r in records})
    lines += ["", "Checks per method:", ""] + [f"* **{m}**: {c}" for m, c in checks]
    failures = [r for r in records if r["outcome"] == "fail"]
    if failures:
        lines += ["", "Failures:", ""] + [f"* {r['method']} on {r['case']}: {r['check']}" for r in failures]
    return "\n".join(lines)


def page(records: list[dict]) -> str:
    """The text of ``docs/conformance.md``: the two tables, the key of their columns and Pyro's own suite."""
    suite = PYRO_SUITE.read_text()
    suite = suite.split("\n", 1)[1].strip("\n") if suite.startswith("# ") else suite.strip("\n")
    return (
        "# What works with what\n\n"
        "Generated from the outcomes of the conformance suite (`tests/conformance/`): every objective, transform, "
        "kernel and post-hoc guide of pyro_flat on a catalogue of Pyro model/guide shapes. Methods with the same "
        "outcome on every case share a column:\n\n" + method_key(records) + "\n\n"
        "## By model feature\n\n" + summary(records) + "\n\n## By catalogue case\n\n" + detail(records) + "\n\n"
        "## Pyro's own test suite\n\n"
        "The outside check: Pyro's `tests/infer/test_valid_models.py` and `test_gradient.py` with each flat objective "
        "swapped in for `Trace_ELBO`, at radius 0 (where it must be `Trace_ELBO`) and at a positive radius "
        "(`scripts/pyro_suite.py`, which needs a Pyro source checkout; not run in CI; its results, "
        "`results/conformance/pyro_suite.md`, follow).\n\n" + suite + "\n"
    )


def render(records: list[dict]) -> None:
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page(records))
    readme = README.read_text()
    if START in readme and END in readme:
        head, rest = readme.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(head + START + "\n" + summary(records) + "\n" + END + tail)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="render the committed outcomes without running")
    args = parser.parse_args(argv)
    if not args.no_run:
        run_suite()
    render(json.loads(OUTCOMES.read_text()))
    print(summary(json.loads(OUTCOMES.read_text())))


if __name__ == "__main__":
    main()

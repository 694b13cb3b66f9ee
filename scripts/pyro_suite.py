"""Pyro's own test suite as an outside check of pyro_flat's objectives.

Runs Pyro's ``tests/infer/test_valid_models.py`` and ``tests/infer/test_gradient.py`` (from a Pyro source checkout
matching the installed pyro-ppl; nothing of Pyro is copied into this repository) with each flat objective swapped in
for ``Trace_ELBO`` (for the mean-field SA-ELBO: ``TraceMeanField_ELBO``) at zero radius and at a positive radius
(``scripts/pyro_suite_plugin.py``), and counts, over the tests that use the swapped class:

* pass;
* refused: the test failed on a ``ValueError``/``NotImplementedError`` raised by pyro_flat that names what it does not
  support (e.g. a discrete or non-reparameterisable guide site, ``AutoDelta`` for the KL ball);
* differs: at a positive radius, an assertion of ``test_gradient.py`` against the hand-derived ``Trace_ELBO``
  gradient, which the flat objectives deliberately change;
* fail: anything else.

Get Pyro's tests with ``git clone https://github.com/pyro-ppl/pyro`` (the files
``tests/{__init__,common,conftest}.py``, ``tests/infer/{__init__,test_valid_models,test_gradient}.py`` and
``setup.cfg``). Takes about 20 minutes on 2 cores; not part of CI.

Run: ``python scripts/pyro_suite.py --pyro-src <pyro checkout>``; writes ``results/conformance/pyro_suite.{json,md}``
(``--no-run`` renders the recorded ``.json`` again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    ("SharpnessAwareELBO", "sa", 0.0), ("SharpnessAwareELBO", "sa", 0.05),
    ("SharpnessAwareMeanFieldELBO", "sa_mf", 0.0), ("SharpnessAwareMeanFieldELBO", "sa_mf", 0.05),
    ("KLBallELBO (Fisher)", "kl_fisher", 0.0), ("KLBallELBO (Fisher)", "kl_fisher", 0.05),
    ("KLBallELBO (normalised score)", "kl_score", 0.0), ("KLBallELBO (normalised score)", "kl_score", 0.05),
]
FILES = ["tests/infer/test_valid_models.py", "tests/infer/test_gradient.py"]


def run(pyro_src: Path, kind: str, radius: float, out: Path) -> tuple[list[dict], float]:
    env = {
        **os.environ, "PYRO_FLAT_SUITE_OBJECTIVE": kind, "PYRO_FLAT_SUITE_RADIUS": str(radius),
        "PYRO_FLAT_SUITE_OUT": str(out), "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(ROOT),
                                                                           str(pyro_src)]),
    }
    command = [sys.executable, "-m", "pytest", *FILES, "-q", "-n", "2", "-p", "pyro_suite_plugin", "-k",
               "FlatObjective", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    subprocess.run(command, cwd=pyro_src, env=env, check=False, capture_output=True)
    return json.loads(out.read_text()), time.perf_counter() - start


def render(details: dict[str, list[dict]], minutes: dict[str, float]) -> str:
    """The Markdown report of the records ``{"<objective> @ <radius>": [{test, outcome, message}]}``."""
    import pyro

    lines = [
        "# Pyro's test suite with pyro_flat's objectives swapped in",
        "",
        f"Pyro's `{'`, `'.join(FILES)}` (pyro-ppl {pyro.__version__} installed; tests from a Pyro source checkout), "
        "restricted to the tests that use the swapped class (`-k FlatObjective`). *refused*: pyro_flat raised a "
        "`ValueError`/`NotImplementedError` of its own naming what it does not support; *differs*: at a positive "
        "radius, a `test_gradient.py` assertion against the hand-derived `Trace_ELBO` gradient, which the flat "
        "objectives change on purpose; *fail*: anything else. The `NothingToPerturbWarning` of a test whose model "
        "observes nothing (the objective is then the base one) is not an error here.",
        "",
        "| objective | radius | tests | pass | refused (clear error) | differs (by design) | fail | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, records in details.items():
        name, radius = key.split(" @ ")
        counts = Counter(r["outcome"] for r in records)
        lines.append(f"| {name} | {radius} | {len(records)} | {counts['pass']} | {counts['refused']} | "
                     f"{counts['differs']} | {counts['fail']} | {minutes.get(key, math.nan):.1f} |")
    lines += ["", "Refusals, by reason (site names replaced by `…`; tests counted over both radii):", ""]
    reasons = Counter()
    for key, records in details.items():
        for r in records:
            if r["outcome"] == "refused":
                reasons[(key.split(" @ ")[0], re.sub(r"'[^']*'", "'…'", r["message"]))] += 1
    lines += [f"* {objective}, {count} tests: {reason}" for (objective, reason), count in sorted(reasons.items())]
    lines += ["", "Failures and differences:", ""]
    for key, records in details.items():
        for r in records:
            if r["outcome"] in ("fail", "differs"):
                message = " ".join(r["message"].split())[:160]
                lines.append(f"* {key} — {r['outcome']}: `{r['test'].split('::')[-1]}` — {message}")
    lines += ["", "Command (Pyro's tests from a checkout of pyro-ppl, e.g. `git clone "
              "https://github.com/pyro-ppl/pyro`):", "", "```bash",
              "python scripts/pyro_suite.py --pyro-src <pyro checkout>", "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyro-src", type=Path, help="a Pyro source checkout (its tests/); required unless --no-run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "conformance" / "pyro_suite.md")
    parser.add_argument("--no-run", action="store_true", help="render the recorded results (the .json) again")
    args = parser.parse_args(argv)
    records_file = args.out.with_suffix(".json")
    if args.no_run:
        saved = json.loads(records_file.read_text())
        details, minutes = saved["records"], saved["minutes"]
    else:
        if args.pyro_src is None:
            parser.error("--pyro-src is required (or --no-run)")
        details, minutes = {}, {}
        for name, kind, radius in CONFIGS:
            scratch = args.out.with_suffix(f".{kind}.{radius}.json")
            records, seconds = run(args.pyro_src, kind, radius, scratch)
            scratch.unlink()
            details[f"{name} @ {radius:g}"], minutes[f"{name} @ {radius:g}"] = records, seconds / 60
        args.out.parent.mkdir(parents=True, exist_ok=True)
        records_file.write_text(json.dumps({"records": details, "minutes": minutes}, indent=1) + "\n")
    text = render(details, minutes)
    args.out.write_text(text)
    print(text.split("\n\nRefusals")[0])


if __name__ == "__main__":
    main()

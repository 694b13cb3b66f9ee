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

Run: ``python scripts/pyro_suite.py --pyro-src <pyro checkout>``; writes ``results/conformance/pyro_suite.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyro-src", type=Path, required=True, help="a Pyro source checkout (its tests/)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "conformance" / "pyro_suite.md")
    args = parser.parse_args(argv)
    import pyro

    lines = [
        "# Pyro's test suite with pyro_flat's objectives swapped in",
        "",
        f"Pyro's `{'`, `'.join(FILES)}` (pyro-ppl {pyro.__version__} installed; tests from a Pyro source checkout), "
        "restricted to the tests that use the swapped class (`-k FlatObjective`). *refused*: pyro_flat raised a "
        "`ValueError`/`NotImplementedError` of its own naming what it does not support; *differs*: at a positive "
        "radius, a `test_gradient.py` assertion against the hand-derived `Trace_ELBO` gradient, which the flat "
        "objectives change on purpose; *fail*: anything else.",
        "",
        "| objective | radius | tests | pass | refused (clear error) | differs (by design) | fail | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    details = {}
    for name, kind, radius in CONFIGS:
        records, seconds = run(args.pyro_src, kind, radius, args.out.with_suffix(f".{kind}.{radius}.json"))
        counts = Counter(r["outcome"] for r in records)
        lines.append(f"| {name} | {radius:g} | {len(records)} | {counts['pass']} | {counts['refused']} | "
                     f"{counts['differs']} | {counts['fail']} | {seconds / 60:.1f} |")
        details[f"{name} @ {radius:g}"] = records
        args.out.with_suffix(f".{kind}.{radius}.json").unlink()
    lines += ["", "Refusals, by reason (the site names in a message replaced by `…`):", ""]
    reasons = Counter()
    for key, records in details.items():
        for r in records:
            if r["outcome"] == "refused":
                reasons[(key.split(" @ ")[0], re.sub(r"'[^']*'", "'…'", r["message"]))] += 1
    lines += [f"* {objective} ({count} tests at both radii): {reason}" for (objective, reason), count in
              sorted(reasons.items())]
    lines += ["", "Failures and differences:", ""]
    for key, records in details.items():
        for r in records:
            if r["outcome"] in ("fail", "differs"):
                lines.append(f"* {key} — {r['outcome']}: `{r['test']}` — {r['message'][:200]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n\nCommand (Pyro's tests from a checkout of pyro-ppl, e.g. with "
                        "`git clone https://github.com/pyro-ppl/pyro`):\n\n```bash\npython scripts/pyro_suite.py "
                        "--pyro-src <pyro checkout>\n```\n")
    args.out.with_suffix(".json").write_text(json.dumps(details, indent=1) + "\n")
    print("\n".join(lines[:6 + len(CONFIGS)]))


if __name__ == "__main__":
    main()

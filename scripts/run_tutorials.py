"""Execute the tutorial notebooks at full size and save them with their outputs (what the repository commits), or
check that the committed outputs are what today's code prints.

This script runs the notebooks as a reader sees them, one at a time: about a minute each for 03-05 and several for
01-02 on 2 idle cores. The tests (``tests/test_tutorials.py``) run 01-02 at smoke size, and 03-05 at full size with
the comparison of ``--check``.

``--check`` executes a copy of each notebook and leaves the file alone. It compares what every code cell prints (its
stdout and its value as text; not figures, not stderr's warnings) with the committed text, and exits 1 naming each cell
that differs and the numbers that differ. Numbers are compared exactly, as printed: the notebooks seed every
generator and run torch on one thread, so a re-run with the same code, torch and CPU prints the same digits (checked:
two runs agree), and the printed precision is already what a reader is told. A tolerance would let through the
small drifts a changed method makes (Entropy-MCMC's 0.9722 -> 0.9741). Another torch build or CPU may change the
last digits of a trained model's metrics: re-run the notebooks there, and check again.

Run: ``python scripts/run_tutorials.py [--check] [NAME ...]`` (default: every notebook in ``tutorials/``).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import nbclient
import nbformat

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def execute(nb: nbformat.NotebookNode, timeout: int = 7200) -> float:
    """Run ``nb`` top to bottom in a fresh kernel started in ``tutorials/``, filling in its outputs; returns the
    seconds taken. Raises ``nbclient.exceptions.CellExecutionError`` (naming the cell) if a cell fails."""
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(TUTORIALS)}}
    ).execute()
    return time.perf_counter() - start


def printed(cell: nbformat.NotebookNode) -> str:
    """What a code cell prints as text: its stdout and the text of its value (not the figures it shows, whose text
    depends on the matplotlib backend, nor stderr's warnings)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type == "execute_result" and "text/plain" in out.data:
            parts.append(out.data["text/plain"] + "\n")
    return "".join(parts)


class Mismatch(NamedTuple):
    """A code cell whose printed text differs from the committed one."""

    notebook: str
    number: int
    first_line: str
    committed: str
    now: str

    def __str__(self) -> str:
        was, now = NUMBER.findall(self.committed), NUMBER.findall(self.now)
        if len(was) == len(now):
            pairs = [f"{a} -> {b}" for a, b in zip(was, now, strict=True) if a != b]
            numbers = "numbers differ: " + ", ".join(pairs) if pairs else "same numbers, other text"
        else:
            numbers = f"{len(was)} numbers committed, {len(now)} printed now"
        return (f"{self.notebook}, code cell {self.number} ({self.first_line!r}): {numbers}\n"
                + _indent("committed", self.committed) + _indent("now", self.now))


def _indent(title: str, text: str) -> str:
    return f"  {title}:\n" + "".join(f"    {line}\n" for line in text.splitlines())


def mismatches(name: str, committed: nbformat.NotebookNode, now: nbformat.NotebookNode) -> list[Mismatch]:
    """The code cells of ``now`` whose printed text differs from ``committed``'s (the same notebook, re-executed);
    numbered from 1 as Jupyter counts them when run top to bottom."""
    old = [c for c in committed.cells if c.cell_type == "code"]
    new = [c for c in now.cells if c.cell_type == "code"]
    if [c.source for c in old] != [c.source for c in new]:
        raise ValueError(f"{name}: the executed notebook's code differs from the committed one")
    return [Mismatch(name, i, a.source.splitlines()[0] if a.source else "", printed(a), printed(b))
            for i, (a, b) in enumerate(zip(old, new, strict=True), start=1) if printed(a) != printed(b)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook file names (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="execute a copy and compare its printed numbers with the committed ones; write nothing")
    args = parser.parse_args(argv)
    paths = [TUTORIALS / n for n in args.names] if args.names else sorted(TUTORIALS.glob("*.ipynb"))
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no notebook {', '.join(missing)} in {TUTORIALS} (names: "
                     f"{', '.join(p.name for p in sorted(TUTORIALS.glob('*.ipynb')))})")
    failed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        seconds = execute(nb)
        if not args.check:
            nbformat.write(nb, path)
            print(f"{path.name}: {seconds:.0f} s, written", flush=True)
            continue
        found = mismatches(path.name, nbformat.read(path, as_version=4), nb)
        failed += found
        verdict = f"{len(found)} cell(s) differ from the committed outputs" if found else "outputs as committed"
        print(f"{path.name}: {seconds:.0f} s, {verdict}", flush=True)
    for mismatch in failed:
        print(mismatch, file=sys.stderr)
    if failed:
        print("re-run them: python scripts/run_tutorials.py " + " ".join(dict.fromkeys(m.notebook for m in failed)),
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

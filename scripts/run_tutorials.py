"""Execute the tutorial notebooks at full size and save them with their outputs (what the repository commits).

The tests run the same notebooks at smoke size (``tests/test_tutorials.py``); this script runs them as a reader
sees them, one at a time, in place. It takes CPU time (minutes per notebook on 2 cores).

Run: ``python scripts/run_tutorials.py [NAME ...]`` (default: every notebook in ``tutorials/``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import nbclient
import nbformat

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def execute(path: Path, timeout: int = 7200) -> float:
    """Run ``path`` top to bottom in a fresh kernel and write it back with its outputs; returns the seconds taken."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook file names (default: all)")
    args = parser.parse_args(argv)
    paths = [TUTORIALS / n for n in args.names] if args.names else sorted(TUTORIALS.glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""The common ending of the benchmark scripts: append the reproducing command, print, write the markdown file."""

from __future__ import annotations

import sys
from pathlib import Path


def write_markdown(lines: list[str], out: Path, script: str, argv: list[str] | None) -> str:
    """Append ``Command: python benchmarks/<script> <args>`` to ``lines``, print the text and write it to ``out``.

    :param argv: the script's arguments as passed to ``main`` (``None``: the command line's).
    """
    command = f"python benchmarks/{Path(script).name} " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join([*lines, "", "Command:", "", "```bash", command.strip(), "```", ""])
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text

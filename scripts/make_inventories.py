"""The intersphinx inventories committed in ``docs/_inventories`` (the docs build reads them: no network needed).

* ``pyro.inv``: the ``objects.inv`` of Pyro's own documentation, built from a checkout of Pyro's ``docs/source``
  (``--pyro-source``; the installed ``pyro`` is what autodoc imports) with Sphinx and copied here. Its entries are
  those of docs.pyro.ai, page for page.
* ``torch.inv``: written from the table below — the PyTorch objects our docstrings and type hints name, with their
  pages on pytorch.org/docs/stable (PyTorch's inventory cannot be fetched offline). Add a row when a docstring names
  a new one.

Run: ``python scripts/make_inventories.py [--pyro-source PATH/TO/pyro/docs/source]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "_inventories"

# (name, role, page): a page of pytorch.org/docs/stable; the anchor is the name itself
TORCH = [
    ("torch.Tensor", "class", "tensors.html"),
    ("torch.device", "class", "tensor_attributes.html"),
    ("torch.dtype", "class", "tensor_attributes.html"),
    ("torch.Generator", "class", "generated/torch.Generator.html"),
    ("torch.argmax", "function", "generated/torch.argmax.html"),
    ("torch.logaddexp", "function", "generated/torch.logaddexp.html"),
    ("torch.autograd.grad", "function", "generated/torch.autograd.grad.html"),
    ("torch.distributed", "module", "distributed.html"),
    ("torch.func.functional_call", "function", "generated/torch.func.functional_call.html"),
    ("torch.func.grad_and_value", "function", "generated/torch.func.grad_and_value.html"),
    ("torch.func.vmap", "function", "generated/torch.func.vmap.html"),
    ("torch.nn.Module", "class", "generated/torch.nn.Module.html"),
    ("torch.nn.Parameter", "class", "generated/torch.nn.parameter.Parameter.html"),
    ("torch.nn.functional.cross_entropy", "function", "generated/torch.nn.functional.cross_entropy.html"),
    ("torch.nn.functional.mse_loss", "function", "generated/torch.nn.functional.mse_loss.html"),
    ("torch.nn.parallel.DistributedDataParallel", "class",
     "generated/torch.nn.parallel.DistributedDataParallel.html"),
    ("torch.optim.Optimizer", "class", "optim.html"),
    ("torch.optim.Adam", "class", "generated/torch.optim.Adam.html"),
    ("torch.optim.SGD", "class", "generated/torch.optim.SGD.html"),
    ("torch.optim.lr_scheduler.LambdaLR", "class", "generated/torch.optim.lr_scheduler.LambdaLR.html"),
    ("torch.optim.swa_utils.update_bn", "function", "optim.html"),
    ("torch.utils.data.BatchSampler", "class", "data.html"),
    ("torch.utils.data.DataLoader", "class", "data.html"),
    ("torch.utils.data.Dataset", "class", "data.html"),
    ("torch.utils.data.Subset", "class", "data.html"),
    ("torch.utils.data.distributed.DistributedSampler", "class", "data.html"),
]


def write_inventory(path: Path, project: str, version: str, entries: list[tuple[str, str, str]]) -> None:
    """A Sphinx ``objects.inv`` (version 2) with ``(name, py role, page)`` entries, each anchored at its name."""
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
              "# The remainder of this file is compressed using zlib.\n")
    body = "".join(f"{name} py:{role} 1 {page}#$ -\n" for name, role, page in sorted(entries))
    path.write_bytes(header.encode() + zlib.compress(body.encode()))


def build_pyro_inventory(source: Path) -> None:
    """Build Pyro's documentation from ``source`` (autodoc of the installed pyro) and keep its ``objects.inv``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(source, src, ignore=shutil.ignore_patterns("conf.py", "_static"))
        (src / "conf.py").write_text(
            'project = "Pyro"\nextensions = ["sphinx.ext.autodoc", "sphinx.ext.mathjax", "sphinx.ext.napoleon"]\n'
            'autodoc_mock_imports = ["graphviz", "funsor", "observations", "pyroapi"]\n'
        )
        subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", str(src), str(Path(tmp) / "out")],
                       check=False)
        shutil.copy(Path(tmp) / "out" / "objects.inv", OUT / "pyro.inv")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyro-source", type=Path, default=None, help="Pyro's docs/source (to rebuild pyro.inv)")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    import torch

    write_inventory(OUT / "torch.inv", "PyTorch", torch.__version__.split("+")[0], TORCH)
    if args.pyro_source is not None:
        build_pyro_inventory(args.pyro_source)


if __name__ == "__main__":
    main()

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


# the pages of Pyro's documentation that document the core library (the contrib pages need extra packages)
PYRO_PAGES = ["primitives", "inference", "inference_algos", "mcmc", "infer.autoguide", "infer.reparam", "infer.util",
              "distributions", "parameters", "nn", "optimization", "poutine"]


def build_pyro_inventory(source: Path) -> None:
    """Build Pyro's core documentation pages from ``source`` (autodoc of the installed pyro) and keep its
    ``objects.inv``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for page in PYRO_PAGES:
            shutil.copy(source / f"{page}.rst", src)
        for text in source.glob("*.txt"):
            shutil.copy(text, src)
        (src / "index.rst").write_text("Pyro\n====\n\n.. toctree::\n\n" + "".join(f"   {p}\n" for p in PYRO_PAGES))
        # no mocked imports: a mocked funsor sends pyro.poutine's singledispatch into an endless loop
        (src / "conf.py").write_text(
            'project = "Pyro"\nextensions = ["sphinx.ext.autodoc", "sphinx.ext.mathjax", "sphinx.ext.napoleon"]\n'
        )
        subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html", str(src), str(Path(tmp) / "out")],
                       check=False)
        add_short_names(Path(tmp) / "out" / "objects.inv", OUT / "pyro.inv")


def add_short_names(source: Path, target: Path) -> None:
    """Copy an inventory, adding for every Python object the shorter public paths it is importable from
    (``pyro.infer.trace_elbo.Trace_ELBO`` is also ``pyro.infer.Trace_ELBO``, the name our docstrings use)."""
    import importlib

    raw = source.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = raw.index(b"\n", header_end) + 1
    lines = zlib.decompress(raw[header_end:]).decode().splitlines()
    names = {line.split(" ", 1)[0] for line in lines}
    extra = []
    for line in lines:
        name, role, priority, uri, display = line.split(" ", 4)
        if role not in ("py:class", "py:function") or "." not in name:
            continue
        module_name, attribute = name.rsplit(".", 1)
        try:
            obj = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            continue
        parts = module_name.split(".")
        for cut in range(1, len(parts)):
            short = ".".join(parts[:cut])
            alias = f"{short}.{attribute}"
            if alias in names:
                continue
            try:
                if getattr(importlib.import_module(short), attribute, None) is obj:
                    uri = uri.replace("$", name) if uri.endswith("$") else uri
                    extra.append(f"{alias} {role} {priority} {uri} {display if display != '-' else name}")
                    names.add(alias)
            except ImportError:
                continue
    target.write_bytes(raw[:header_end] + zlib.compress("\n".join(lines + extra).encode() + b"\n"))


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

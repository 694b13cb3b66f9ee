"""Sphinx configuration of the pyro_flat documentation (build: ``sphinx-build -W -b html docs docs/_build/html``).

Pages are MyST Markdown; the tutorials are rendered by MyST-NB with the outputs committed in the notebooks (nothing
is executed at build time); the API reference is autosummary + autodoc over every public module. Intersphinx links
to Pyro and PyTorch resolve through inventories committed in ``docs/_inventories`` (no network at build time), and the
maths is rendered by a copy of MathJax served with the pages (``sphinx-mathjax-offline``), so it reads without a
network too.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import pyro_flat  # noqa: E402

project = "pyro_flat"
author = "the pyro_flat developers"
copyright = "the pyro_flat developers, Apache-2.0"
release = version = pyro_flat.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinx-mathjax-offline",  # MathJax 3 copied into _static/mathjax: formulas render without a network
]

# --- MyST Markdown and notebooks -----------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebooks are committed with the outputs of a full run; never executed here
nb_merge_streams = True
mathjax_path = "mathjax/tex-chtml.js"  # the bundled copy (relative to _static), never a CDN

# The tutorials live in the repository's tutorials/ folder; the build reads a copy (docs/tutorials is ignored by git).
_TUTORIALS = DOCS / "tutorials"
_TUTORIALS.mkdir(exist_ok=True)
for _old in _TUTORIALS.glob("*.ipynb"):
    if not (ROOT / "tutorials" / _old.name).exists():
        _old.unlink()
for _notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
    shutil.copy2(_notebook, _TUTORIALS / _notebook.name)

exclude_patterns = ["_build", "tutorials/.ipynb_checkpoints", "**/.ipynb_checkpoints"]
suppress_warnings = ["mystnb.unknown_mime_type"]

# --- API reference -------------------------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False  # each object once, where it is defined
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_inherit_docstrings = False  # Pyro's and torch's own docstrings are documented by them, not here
autoclass_content = "class"
napoleon_use_param = True
napoleon_use_rtype = False
templates_path = ["_templates"]

# --- Links to Pyro and PyTorch, offline ----------------------------------------------------------------------------
intersphinx_mapping = {
    "pyro": ("https://docs.pyro.ai/en/stable/", str(DOCS / "_inventories" / "pyro.inv")),
    "torch": ("https://pytorch.org/docs/stable/", str(DOCS / "_inventories" / "torch.inv")),
}

# --- HTML -----------------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"pyro_flat {version}"
html_static_path: list[str] = []

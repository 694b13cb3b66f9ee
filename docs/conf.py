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
# Every class and function is documented once, at its public import path: the shortest one among the packages of the
# reference that export it in their __all__ (pyro_flat.infer.SharpnessAwareELBO, not
# pyro_flat.infer.elbo.sharpness_aware.SharpnessAwareELBO), or where it is defined if no package exports it. The page
# of the defining module keeps its docstring and links there; references to any other path of the object resolve to
# the public one.
API_PACKAGES = ("pyro_flat.data", "pyro_flat.nn", "pyro_flat.infer", "pyro_flat.transforms", "pyro_flat.optim",
                "pyro_flat.metrics", "pyro_flat.ops", "pyro_flat.runtime", "pyro_flat.distributed",
                "pyro_flat.testing", "pyro_flat.bench")


def _api_paths() -> tuple[dict[str, dict[str, list]], dict[str, str]]:
    """``({module: {"classes": [...], "functions": [...], "elsewhere": [(name, public path)]}}, {other path: public
    path})`` over every module of :data:`API_PACKAGES`: what each module's page documents, and what it links to."""
    import importlib
    import inspect
    import pkgutil

    modules = {}
    for package in API_PACKAGES:
        root = importlib.import_module(package)
        modules[package] = root
        for info in pkgutil.walk_packages(getattr(root, "__path__", []), prefix=package + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                modules[info.name] = importlib.import_module(info.name)
    paths: dict[object, list[str]] = {}
    for name, module in modules.items():
        for attr, obj in vars(module).items():
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name \
                    and not attr.startswith("_"):
                paths.setdefault(obj, []).append(f"{name}.{attr}")
    for name, module in modules.items():
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj in paths:
                paths[obj].append(f"{name}.{attr}")
    pages: dict[str, dict[str, list]] = {name: {"classes": [], "functions": [], "elsewhere": []} for name in modules}
    public: dict[str, str] = {}
    for obj, candidates in paths.items():
        best = min(candidates, key=lambda path: (path.count("."), path))
        module, attr = best.rsplit(".", 1)
        pages[module]["classes" if inspect.isclass(obj) else "functions"].append(attr)
        for path in candidates:  # the defining module and every other package that exports it link to it
            if path != best:
                module, attr = path.rsplit(".", 1)
                pages[module]["elsewhere"].append((attr, best))
                public[path] = best
    for entry in pages.values():
        for key in ("classes", "functions", "elsewhere"):
            entry[key] = sorted(set(entry[key]))
    return pages, public


API_PAGES, PUBLIC_PATHS = _api_paths()
autosummary_generate = True
autosummary_imported_members = False  # the template lists what each page documents (API_PAGES), nothing else
autosummary_context = {"api_pages": API_PAGES}
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_inherit_docstrings = False  # Pyro's and torch's own docstrings are documented by them, not here
autoclass_content = "class"
napoleon_use_param = True
napoleon_use_rtype = False
templates_path = ["_templates"]


def _public_reference(app, env, node, contnode):  # noqa: ANN001, ANN202  (Sphinx's missing-reference hook)
    """A reference to another path of a documented object (``pyro_flat.infer.mcmc.SGLD``) links to its public page."""
    target = PUBLIC_PATHS.get(node.get("reftarget", ""))
    if node.get("refdomain") != "py" or target is None:
        return None
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"], target, node,
                                             contnode)


def setup(app) -> None:  # noqa: ANN001
    app.connect("missing-reference", _public_reference)


# --- Links to Pyro and PyTorch, offline ----------------------------------------------------------------------------
intersphinx_mapping = {
    "pyro": ("https://docs.pyro.ai/en/stable/", str(DOCS / "_inventories" / "pyro.inv")),
    "torch": ("https://pytorch.org/docs/stable/", str(DOCS / "_inventories" / "torch.inv")),
}

# --- HTML -----------------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"pyro_flat {version}"
html_static_path = ["_static"]
html_css_files = ["wrap-code.css"]  # long code lines wrap instead of being cut off

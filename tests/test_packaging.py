"""What ships with the package: the licence the metadata names, the typing marker, one version string."""

from pathlib import Path

import pytest

import pyro_flat
from pyro_flat.bench.cli import main

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_licence_the_metadata_names():
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a notice


def test_type_hints_ship_with_the_package():
    assert (Path(pyro_flat.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["pyro_flat"]


def test_one_version_string(capsys):
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pyro_flat.__version__"}
    # the command line's --version (`python -m pyro_flat` itself runs in a new process in tests/bench/test_scale.py)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pyro_flat {pyro_flat.__version__}"


def test_every_extra_is_reachable_from_all():
    extras = PYPROJECT["project"]["optional-dependencies"]
    reached = extras["all"][0].split("[", 1)[1].rstrip("]").split(",")
    assert set(reached) == set(extras) - {"all"}

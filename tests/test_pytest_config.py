"""The suite runs under the project's pytest settings (pyproject.toml) whatever pytest plugins are installed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_installed_pytest_benchmark_does_not_change_the_settings(tmp_path):
    # pytest-benchmark (installed on GPU machines) warns in pytest_configure when xdist is active ("Benchmarks are
    # automatically disabled ..."), which filterwarnings = error turned into an INTERNALERROR: no test ran. A stand-in
    # registered under the same plugin name warns the same way; the suite's settings leave it out
    plugin = tmp_path / "site"
    (plugin / "pytest_benchmark_stand_in-1.0.dist-info").mkdir(parents=True)
    (plugin / "pytest_benchmark_stand_in-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pytest-benchmark-stand-in\nVersion: 1.0\n")
    (plugin / "pytest_benchmark_stand_in-1.0.dist-info" / "entry_points.txt").write_text(
        "[pytest11]\nbenchmark = pytest_benchmark_stand_in\n")
    (plugin / "pytest_benchmark_stand_in.py").write_text(
        "import warnings\n\nimport pytest\n\n\ndef pytest_configure(config):\n"
        "    warnings.warn(pytest.PytestWarning('Benchmarks are automatically disabled because xdist plugin is "
        "active.'))\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
               "-p", "no:cacheprovider", "-n", "0", str(tmp_path / "test_one.py")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(plugin)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout + result.stderr
    # without the settings' addopts the stand-in is loaded and stops the run, as pytest-benchmark did
    unprotected = subprocess.run([*command, "-o", "addopts=-n 0"], capture_output=True, text=True, env=env,
                                 timeout=120, check=False)
    assert unprotected.returncode != 0 and "INTERNALERROR" in unprotected.stdout + unprotected.stderr

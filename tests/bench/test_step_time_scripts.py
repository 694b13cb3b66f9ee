"""The SVI step-time benchmarks of ``benchmarks/`` run end to end at a tiny size (their timings are not checked)."""

import importlib.util
from pathlib import Path

import pyro
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def _float32_and_threads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import `_svi_steps` and `_timing`
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    pyro.enable_validation(True)


@pytest.mark.parametrize("name", ["sharpness_aware_elbo", "kl_ball_elbo"])
def test_step_time_script_runs_and_writes_its_table(name, tmp_path):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / f"{name}.md"
    module.main(["--repeats", "1", "--steps", "1", "--out", str(out)])
    text = out.read_text()
    assert "| ratio | value | target |" in text and "torch BBB" in text
    assert "nan" not in text.lower()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")  # Pyro's JitTrace_ELBO
def test_compiled_step_time_script_runs_and_writes_its_table(tmp_path):
    """benchmarks/compiled.py at a tiny size, its compiled variants as captured graphs (no compilation time)."""
    spec = importlib.util.spec_from_file_location("compiled", BENCHMARKS / "compiled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "compiled.md"
    module.main(["--repeats", "1", "--steps", "1", "--warmup", "3", "--draws", "10", "--jit-backend", "none",
                 "--warm-cache", "--out", str(out)])
    text = out.read_text()
    assert "| ratio | eager | compiled | goal |" in text and "JitSharpnessAwareELBO" in text
    assert "not compiled" in text and "nan" not in text.lower()
    rows = [line for line in text.splitlines() if line.startswith("| ") and " / torch " in line]
    assert len(rows) == 7


def test_compile_options_script_runs(tmp_path):
    """benchmarks/compile_options.py at a tiny size, torch.compile with its cheap `eager` backend."""
    spec = importlib.util.spec_from_file_location("compile_options", BENCHMARKS / "compile_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.main(["--repeats", "1", "--steps", "1", "--backend", "eager", "--warm-cache",
                        "--out", str(tmp_path / "c.md")])
    assert text.count("| ") >= 7 and "torch.jit.trace" in text and "nan" not in text.lower()

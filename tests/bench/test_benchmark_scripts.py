"""The remaining ``benchmarks/`` scripts run end to end at a tiny size, as a user runs them (their figures are not
checked here; the committed tables come from the full-size runs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("bayesian_sam.py", ["--repeats", "1", "--steps", "1", "--out", "{tmp}/bayesian_sam.md"], "SWAGCollector"),
        ("bsam_two_moons.py", ["--epochs", "2", "--samples", "2", "--out", "{tmp}"], "bSAM"),
        ("draws_kept.py", ["--repeats", "1", "--draws", "3", "--jit-backend", "none", "--out", "{tmp}/d.md"],
         "same seed: equal"),
        ("entropy_mcmc_constrained.py", ["--smoke", "--out", "{tmp}/emc.md"], "Entropy-MCMC anchors"),
        ("harness_epoch.py", ["--methods", "map", "--num-data", "64", "--batch", "32", "--width", "2", "--epochs", "2",
                              "--repeats", "1", "--variants", "device", "--out", "{tmp}/h.md"], "| map | device |"),
        ("memory.py", ["--draws", "2", "--warmup", "1", "--out", "{tmp}/memory.md"], "StreamingBMA"),
        ("memory_resnet.py", ["--batch", "2", "--steps", "1", "--cells", "torch SGD step", "--out", "{tmp}/m.md"],
         "torch SGD step"),
        ("resnet18_steps.py", ["--width", "2", "--num-data", "16", "--batch", "4", "--repeats", "1", "--steps", "1",
                               "--warmup", "0", "--inner-steps", "2", "--out", "{tmp}/r.md"],
         "| BayesianSAM | SAM(SGD) |"),
        ("scale_costs.py", ["--batch", "4", "--repeats", "1", "--methods", "map", "--networks", "ResNet-18", "--out",
                            "{tmp}/s.md"], "Estimated GPU hours"),
        ("trajectory_paired.py", [str(ROOT / "results" / "trajectory" / "results.json")], "Paired differences"),
    ],
)
@pytest.mark.slow
def test_benchmark_script_runs(script, args, expected, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / script), *(a.format(tmp=tmp_path) for a in args)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout

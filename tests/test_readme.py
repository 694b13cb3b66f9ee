"""The README stays true: its commands are what CI runs, its quick start runs, its links resolve, its table is the
rendering of the committed results, and it stays a front door (at most 200 lines)."""

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 200


def test_ci_runs_the_readme_test_command_then_builds_the_docs():
    # the README's test command and docs command, verbatim and in that order (then the lowest-versions smoke job)
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    blocks = [block.strip() for block in _code_blocks("bash")]
    (test_command,) = [b for b in blocks if "pytest" in b and "venv" in b]
    (docs_command,) = [b for b in blocks if "sphinx -W" in b]
    assert test_command in lines and docs_command in lines
    assert lines.index(test_command) < lines.index(docs_command)
    assert any(".venv-lowest/bin/python -m pytest" in line for line in lines)


def test_main_job_command_runs_the_harness():
    blocks = [b.strip() for b in _code_blocks("bash")]
    main_job = [b for b in blocks if "pyro_flat bench" in b and "venv" in b]
    assert main_job and "--preset quick" in main_job[0] and "--methods all" in main_job[0]


def test_quick_start_runs_and_prints_what_the_readme_says(capsys):
    torch.set_default_dtype(torch.float32)  # a reader's default (the test fixture restores float64 afterwards)
    (block,) = [b for b in _code_blocks("python") if "Predictive" in b]
    namespace: dict = {}
    exec(compile(block, "README quick start", "exec"), namespace)
    printed = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    claimed = ast.literal_eval(block.strip().splitlines()[-1].lstrip("# "))
    # seeded: the same numbers, up to the last printed digit (sums of floats may round differently on another CPU)
    assert printed.keys() == claimed.keys()
    assert all(abs(printed[k] - claimed[k]) <= 0.002 for k in claimed), (printed, claimed)
    assert printed["acc"] > 0.9  # and the pipeline learned (chance: 0.1)


def test_gpu_recipe_is_lines_of_the_guide_recipe_that_the_docs_tests_run():
    (block,) = [b for b in _code_blocks("python") if "TensorSVI" in b]
    guide = (ROOT / "docs" / "guide" / "gpus-and-parallelism.md").read_text()
    section = guide.split("\n## The fast recipe on a GPU\n", 1)[1].split("\n## ", 1)[0]  # tests/test_docs.py runs it
    tested = {line for code in re.findall(r"```python\n(.*?)```", section, flags=re.S) for line in code.splitlines()}
    assert [line for line in block.splitlines() if line.strip() and line not in tested] == []


def test_relative_links_resolve():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing


def test_flat_vs_base_table_is_the_rendering_of_the_results(script):
    pages = script("results_pages")
    assert pages.readme_with_summary(README) == README
    block = README.split(pages.START, 1)[1].split(pages.END, 1)[0]
    assert block.count("\n|") >= 10  # one row per pair and data set


@pytest.mark.slow
def test_main_job_then_the_docs_tests_in_one_checkout(tmp_path):
    """The README's two commands in either order: the main job (its own command, at a smoke size: two methods, one
    epoch) writes results/quick into a copy of this checkout, beside a run of one's own in results/mine (the quick
    start guide's example); then the docs and README tests that read results/ pass in that checkout. (The tests that
    execute the pages' code read no results and run in the suite itself.)"""
    checkout = tmp_path / "checkout"
    build = shutil.ignore_patterns(".git", ".venv*", ".ci-*", "_build", "__pycache__", "*_cache", "*.egg-info")
    shutil.copytree(ROOT, checkout, ignore=lambda folder, names: build(folder, names) | (
        {"quick", "mine"} if Path(folder) == ROOT / "results" else set()))
    (main_job,) = [b.strip() for b in _code_blocks("bash") if "pyro_flat bench" in b and "venv" in b]
    argv = shlex.split(main_job.rsplit(".venv/bin/python", 1)[1])
    assert argv[:2] == ["-m", "pyro_flat"] and argv[argv.index("--out") + 1] == "results/quick"
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    smoke = ["--methods", "map", "sam", "--epochs", "1", "--bma-samples", "2", "--lambda-max-iters", "2",
             "--no-progress"]
    run = subprocess.run([sys.executable, *argv, *smoke], cwd=checkout, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    quick = checkout / "results" / "quick"
    assert (quick / "results.json").is_file() and (quick / "flat_vs_base_digits.png").is_file()
    shutil.copytree(quick, checkout / "results" / "mine")
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py", "tests/test_readme.py",
         "-k", "result_sections or flat_vs_base_table"],  # the two that read results/ (the checkout has no git)
        cwd=checkout, env=env, capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert "2 passed" in tests.stdout and "failed" not in tests.stdout

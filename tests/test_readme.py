"""The README stays true: its commands are what CI runs, its quick start runs, its links resolve, its table is the
rendering of the committed results, and it stays a front door (at most 200 lines)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 200


def test_ci_runs_the_readme_test_command_then_builds_the_docs():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_lines = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    blocks = [block.strip() for block in _code_blocks("bash")]
    assert len(ci_lines) == 2
    test_command, docs_command = ci_lines
    assert test_command in blocks and "pytest" in test_command
    assert docs_command in blocks and "sphinx -W" in docs_command


def test_main_job_command_runs_the_harness():
    blocks = [b.strip() for b in _code_blocks("bash")]
    main_job = [b for b in blocks if "pyro_flat bench" in b and "venv" in b]
    assert main_job and "--preset quick" in main_job[0] and "--methods all" in main_job[0]


def test_quick_start_runs(capsys):
    (block,) = [b for b in _code_blocks("python") if "Predictive" in b]
    namespace: dict = {}
    exec(compile(block, "README quick start", "exec"), namespace)
    report = namespace["report"]
    # 300 VI steps on digits: the README claims acc ≈ 0.97; a broken pipeline would be near 0.1
    assert report["acc"] > 0.9
    assert report["nll"] < 0.4
    assert "acc" in capsys.readouterr().out


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

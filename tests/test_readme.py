"""The README stays true: its quick start runs, and CI runs exactly its test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_lines = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert len(ci_lines) == 1
    assert any(block.strip() == ci_lines[0] for block in _code_blocks("bash"))
    assert "pytest" in ci_lines[0]


def test_main_job_command_runs_the_harness():
    blocks = [b.strip() for b in _code_blocks("bash")]
    main_job = [b for b in blocks if "pyro_flat bench" in b and "venv" in b]
    assert main_job and "--preset quick" in main_job[0]


def test_quick_start_runs(capsys):
    (block,) = [b for b in _code_blocks("python") if "Predictive" in b]
    namespace: dict = {}
    exec(compile(block, "README quick start", "exec"), namespace)
    report = namespace["report"]
    # 300 VI steps on digits: the README claims acc ≈ 0.97; a broken pipeline would be near 0.1
    assert report["acc"] > 0.9
    assert report["nll"] < 0.4
    assert "acc" in capsys.readouterr().out


def test_what_works_with_what_table_is_the_rendering_of_the_suite_outcomes():
    # the README table is generated from the conformance suite's recorded outcomes, never edited by hand
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("conformance_table", ROOT / "scripts" / "conformance_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    records = json.loads(table.OUTCOMES.read_text())
    block = README.split(table.START, 1)[1].split(table.END, 1)[0].strip()
    assert block == table.summary(records)
    assert not [r for r in records if r["outcome"] == "fail"]

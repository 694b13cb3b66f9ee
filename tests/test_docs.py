"""The documentation stays true: generated pages equal their generators' output, and the code on the guide and
method pages runs (the Sphinx build itself runs in CI with warnings as errors, after the tests)."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# pages whose Python blocks form one runnable script (other pages show fragments)
RUNNABLE = ["guide/quickstart.md", "guide/your-own-model.md", "methods/sharpness-aware.md", "methods/kl-ball.md",
            "methods/trajectories.md", "methods/sgmcmc.md"]


def test_result_pages_are_the_rendering_of_the_results(script):
    pages = script("results_pages").pages()
    assert len(pages) >= 10
    for path, text in pages.items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python scripts/results_pages.py"
    committed = set(DOCS.glob("results/*.md"))
    assert committed == set(pages), "a page in docs/results/ has no source under results/"


def test_every_result_page_is_shown_and_every_figure_exists():
    text = "".join(p.read_text() for p in DOCS.glob("**/*.md") if "results" not in p.parts)
    for page in DOCS.glob("results/*.md"):
        assert f"results/{page.name}" in text, f"{page.name} is included by no page"
        for figure in re.findall(r"!\[[^]]*\]\(\.\./\.\./([^)]+)\)", page.read_text()):
            assert (ROOT / figure).is_file(), figure


def test_conformance_page_is_the_rendering_of_the_suite_outcomes(script):
    table = script("conformance_table")
    records = json.loads(table.OUTCOMES.read_text())
    page = table.PAGE.read_text()
    assert table.summary(records) in page and table.detail(records) in page
    assert not [r for r in records if r["outcome"] == "fail"]


def test_no_page_points_outside_the_repository():
    for page in DOCS.glob("**/*.md"):
        text = page.read_text()
        for name in ("ALGORITHMS.md", "TESTING.md", "DESIGN.md", "STYLE.md", "/work/"):
            assert name not in text, (page, name)


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_code_runs(page, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    assert blocks
    namespace: dict = {}
    exec(compile("\n".join(blocks), page, "exec"), namespace)
    if page == "guide/your-own-model.md":  # the fits learned (two moons: chance is 0.5)
        assert "flat VI  acc" in capsys.readouterr().out
        assert namespace["report"]["acc"] > 0.8

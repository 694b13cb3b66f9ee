"""The result sections of the documentation, generated from a declared list of committed results (never edited by
hand).

A page under ``docs/`` shows a result between two markers::

    <!-- generated from results/sharpness_aware/results.json by scripts/results_pages.py; do not edit -->
    ...
    <!-- end of generated text -->

and this script writes the text between them from the named source: a harness run of :data:`HARNESS_RUNS` (a
``results.json`` written by ``python -m pyro_flat bench``: command, configuration, the table over seeds, the
differences of each method from its base paired by seed and the flat-vs-base figure), a few-shot transfer run of
``benchmarks/sa_bma_transfer.py`` (:data:`TRANSFER_RUNS`), the summary of every method against its base
(``results/*/results.json``: the runs of :data:`SUMMARY_RUNS`), or a Markdown file a benchmark wrote (its text, less
its title). The pages are plain Markdown, so they read the same on the repository and in the built documentation.
The README's flat-vs-base table between its ``flat-vs-base`` markers is generated the same way. ``--figures`` also
redraws the flat-vs-base figures ``results/<run>/flat_vs_base_*.png`` (what the harness writes after a run) from the
JSON.

Only the declared runs are read: a run of your own (``--out results/mine``, or the README's ``results/quick``) changes
nothing here. To show a new run, commit its folder and add it to :data:`HARNESS_RUNS`.

Run: ``python scripts/results_pages.py [--figures]``. ``tests/test_docs.py`` checks that the committed pages equal
this script's output.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyro_flat.bench import methods as _methods  # noqa: E402, F401  (fills the registry)
from pyro_flat.bench.report import flat_base_pairs, plot_flat_vs_base, summary_table  # noqa: E402

RESULTS = ROOT / "results"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
START, END = "<!-- flat-vs-base:start -->", "<!-- flat-vs-base:end -->"
BEGIN_MARK = "<!-- generated from {source} by scripts/results_pages.py; do not edit -->"
END_MARK = "<!-- end of generated text -->"
SECTION = re.compile(r"<!-- generated from (results/[^\s<>]+) by scripts/results_pages\.py; do not edit -->\n.*?"
                     + re.escape(END_MARK), flags=re.S)
SUMMARY = "results/*/results.json"

HARNESS_RUNS = ("baselines", "sharpness_aware", "sgmcmc", "f_sgld", "trajectory", "kl_ball",
                "trajectory_sensitivity/bsam_lr0.25", "trajectory_sensitivity/m_sharpness8",
                "efficient_sam/sam", "efficient_sam/sam_looksam5", "efficient_sam/sam_looksam5_alpha0.3",
                "efficient_sam/sam_looksam5_alpha0.1", "efficient_sam/sam_rst0.5", "efficient_sam/sam_rst0.25",
                "efficient_sam/f_vi", "efficient_sam/f_vi_looksam5", "efficient_sam/f_vi_looksam5_alpha0.3",
                "efficient_sam/f_vi_looksam5_alpha0.1", "efficient_sam/f_vi_rst0.5")
"""The committed harness runs the documentation shows (folders under ``results/``)."""
CHEAPER_STEPS = "results/efficient_sam/*/results.json"
"""The source of the cheaper sharpness-aware steps' comparison (:data:`CHEAPER_STEP_RUNS`)."""
CHEAPER_STEP_RUNS = {
    # family: ((setting, harness run, method), ...): the base first, then the full sharpness-aware method, then its
    # cheaper steps
    "SAM (AutoDelta + SharpnessAwareELBO) against MAP": (
        ("base: map", "efficient_sam/sam", "map"),
        ("full: sam", "efficient_sam/sam", "sam"),
        ("sam, LookSAM k=5 (α 0.7)", "efficient_sam/sam_looksam5", "sam"),
        ("sam, LookSAM k=5, α 0.3", "efficient_sam/sam_looksam5_alpha0.3", "sam"),
        ("sam, LookSAM k=5, α 0.1", "efficient_sam/sam_looksam5_alpha0.1", "sam"),
        ("sam, RST p=0.5", "efficient_sam/sam_rst0.5", "sam"),
        ("sam, RST p=0.25", "efficient_sam/sam_rst0.25", "sam"),
    ),
    "F-VI (AutoNormal + SharpnessAwareELBO) against VI": (
        ("base: vi", "efficient_sam/f_vi", "vi"),
        ("full: f_vi", "efficient_sam/f_vi", "f_vi"),
        ("f_vi, LookSAM k=5 (α 0.7)", "efficient_sam/f_vi_looksam5", "f_vi"),
        ("f_vi, LookSAM k=5, α 0.3", "efficient_sam/f_vi_looksam5_alpha0.3", "f_vi"),
        ("f_vi, LookSAM k=5, α 0.1", "efficient_sam/f_vi_looksam5_alpha0.1", "f_vi"),
        ("f_vi, RST p=0.5", "efficient_sam/f_vi_rst0.5", "f_vi"),
    ),
}
"""The committed runs of the cheaper sharpness-aware steps (issue 22), compared setting by setting, paired by seed."""
KEPT_REDUCTION = 0.8
"""The goal's share of the full method's λ_max reduction a cheaper step keeps."""
TRANSFER_RUNS = ("kl_ball/transfer_table.json", "kl_ball/transfer_radius_sweep.json")
"""The committed few-shot transfer runs of ``benchmarks/sa_bma_transfer.py`` (under ``results/``)."""

# (metric, header, scale, format, lower is better)
DIFFERENCES = (
    ("acc", "Δ acc (points)", 100.0, "{:+.2f}", False),
    ("nll", "Δ NLL", 1.0, "{:+.4f}", True),
    ("ece", "Δ ECE", 1.0, "{:+.4f}", True),
    ("lambda_max", "Δ λ_max", 1.0, "{:+.3g}", True),
)
# the runs whose pairs make the summary (README and docs/methods/index.md), with the method page of each
SUMMARY_RUNS = {"sharpness_aware": "sharpness-aware", "sgmcmc": "sgmcmc", "f_sgld": "sgmcmc",
                "trajectory": "trajectories", "kl_ball": "kl-ball"}
# the README shows the main flat method of each family (the docs' summary shows every pair)
README_METHODS = ("f_vi", "sam", "f_mc_dropout", "f_ensemble", "emcmc", "f_sgld", "bsam", "f_swag", "hwa", "sa_bma")
COLLAPSE_POINTS = 5.0
"""A seed on which a method's accuracy is this many points or more below its base's is named under the
summary: one such seed dominates the mean and spread of its row."""


def harness_runs() -> list[Path]:
    """The ``results.json`` of every declared harness run (:data:`HARNESS_RUNS`)."""
    return [RESULTS / run / "results.json" for run in HARNESS_RUNS]


def _paired(records: list[dict], dataset: str, method: str, base: str, key: str, scale: float) -> list[float]:
    """method - base per seed (seeds both ran), times ``scale``."""
    return [d for _, d in _paired_by_seed(records, dataset, method, base, key, scale)]


def _paired_by_seed(records: list[dict], dataset: str, method: str, base: str, key: str,
                    scale: float) -> list[tuple[int, float]]:
    value = {(r["method"], r["seed"]): r["metrics"].get(key) for r in records if r["dataset"] == dataset}
    seeds = sorted(s for m, s in value if m == method and value.get((base, s)) is not None)
    return [(s, scale * (value[method, s] - value[base, s])) for s in seeds if value[method, s] is not None]


def _difference_cell(diffs: list[float], fmt: str, lower_is_better: bool) -> str:
    if not diffs:
        return "–"
    mean = statistics.mean(diffs)
    better = sum((d < 0) if lower_is_better else (d > 0) for d in diffs)
    spread = "" if len(diffs) < 2 else " ± " + fmt.format(statistics.stdev(diffs)).lstrip("+")
    return f"{fmt.format(mean)}{spread} ({better}/{len(diffs)})"


def _pairs(records: list[dict], datasets: list[str], only: tuple[str, ...] | None) -> list[tuple[str, str, str]]:
    """``(dataset, method, base)`` of every method whose base ran (of ``only``, if given)."""
    out = []
    for dataset in datasets:
        methods = list(dict.fromkeys(r["method"] for r in records if r["dataset"] == dataset))
        out += [(dataset, method, base) for method, base in flat_base_pairs(methods) if only is None or method in only]
    return out


def differences_table(records: list[dict], datasets: list[str], *, with_run: str | None = None,
                      only: tuple[str, ...] | None = None) -> list[str]:
    """Rows of method-minus-base differences paired by seed: mean ± std (seeds where the method is better).

    :param only: the methods to show (default: every method whose base ran).
    """
    lines = []
    for dataset, method, base in _pairs(records, datasets, only):
        cells = [_difference_cell(_paired(records, dataset, method, base, key, scale), fmt, lower)
                 for key, _, scale, fmt, lower in DIFFERENCES]
        first = [with_run] if with_run is not None else []
        lines.append("| " + " | ".join([*first, dataset, f"{method} vs {base}", *cells]) + " |")
    return lines


def collapsed_seeds(records: list[dict], datasets: list[str], only: tuple[str, ...] | None = None) -> list[str]:
    """One sentence per seed on which a method lost :data:`COLLAPSE_POINTS` or more accuracy points to its
    base, with the row's accuracy difference over the other seeds."""
    notes = []
    for dataset, method, base in _pairs(records, datasets, only):
        diffs = _paired_by_seed(records, dataset, method, base, "acc", 100.0)
        acc = {(r["method"], r["seed"]): 100 * r["metrics"]["acc"] for r in records if r["dataset"] == dataset}
        for seed, diff in diffs:
            if diff > -COLLAPSE_POINTS:
                continue
            rest = [d for s, d in diffs if s != seed]
            without = "" if not rest else (f"; over the other {len(rest)} seeds Δ acc is "
                                           f"{_difference_cell(rest, '{:+.2f}', False)}")
            notes.append(f"{method} vs {base} on {dataset}: seed {seed} collapsed ({method} {acc[method, seed]:.1f} % "
                         f"against {base} {acc[base, seed]:.1f} % accuracy){without}.")
    return notes


def _config_line(config: dict) -> str:
    hidden = "-".join(str(h) for h in config["hidden"])
    return (f"{config['model'].upper()} {hidden}, prior N(0, {config['prior_scale']:g}²), {config['num_epochs']} "
            f"epochs, minibatches of {config['batch_size']}, Adam lr {config['lr']:g}, {config['num_bma_samples']} "
            f"posterior draws per prediction, ensembles of {config['ensemble_size']}, λ_max at "
            f"{config['lambda_max_draws']} draws on {config['lambda_max_points']} training points, "
            f"{config['dtype']} on {config['device']}"
            + (f"; options {config['options']}" if config.get("options") else ""))


def _link(target: Path, page: Path) -> str:
    """``target`` relative to the folder of ``page`` (as a Markdown link needs it)."""
    return Path(os.path.relpath(target, page.parent)).as_posix()


def harness_section(run: Path, page: Path) -> str:
    """A harness run (its ``results.json``) as shown on ``page``."""
    payload = json.loads(run.read_text())
    records, rows = payload["records"], payload["summary"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    env = payload["environment"]
    command = payload["command"].replace(" --no-progress", "")
    lines = [f"Command: `{command}`", "",
             f"Configuration: {_config_line(payload['config'])}. Measured with torch {env['torch']}, Pyro "
             f"{env['pyro']}, {env['threads']} thread(s); fit times are indicative (the machine was shared).", "",
             "Mean ± standard deviation over seeds:", "", summary_table(rows).rstrip("\n")]
    differences = differences_table(records, datasets)
    if differences:
        lines += ["", "Each method minus its base (the method it is compared with), paired by seed: mean ± std (seeds "
                  "where the method is better / seeds):", "",
                  "| dataset | pair | " + " | ".join(h for _, h, *_ in DIFFERENCES) + " |",
                  "|---" * (len(DIFFERENCES) + 2) + "|", *differences]
    for dataset in datasets:
        methods = list(dict.fromkeys(r["method"] for r in records if r["dataset"] == dataset))
        if flat_base_pairs(methods):
            figure = _link(run.parent / f"flat_vs_base_{dataset}.png", page)
            lines += ["", f"![{dataset}: each method minus its base, per seed]({figure})"]
    return "\n".join(lines)


def _load_benchmark(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def transfer_section(path: Path) -> str:
    """A few-shot transfer run of ``benchmarks/sa_bma_transfer.py``, re-rendered from its JSON."""
    transfer = _load_benchmark("sa_bma_transfer")
    payload = json.loads(path.read_text())
    args = argparse.Namespace(**{k: _literal(v) for k, v in payload["args"].items()})
    return (transfer.describe(payload["command"], args) + transfer.table(payload["records"])).strip("\n")


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def markdown_section(path: Path, page: Path) -> str:
    """A Markdown file a benchmark wrote, less its title, with its relative image links made relative to ``page``."""
    text = path.read_text()
    if text.startswith("# "):
        text = text.split("\n", 1)[1] if "\n" in text else ""

    def relink(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith("/"):
            return match.group(0)
        return f"![{match.group(1)}]({_link(path.parent / target, page)})"

    return re.sub(r"!\[([^]]*)\]\(([^)\s]+)\)", relink, text).strip("\n")


def summary(link: str, only: tuple[str, ...] | None = None) -> str:
    """Each method against its base (a flat method and its non-flat base, or another comparison: ``swag`` against
    ``map``), paired by seed, over the comparisons of each method family, and the seeds that collapsed.

    :param link: the method page's link, formatted with ``page`` (e.g. ``"docs/methods/{page}.md"``).
    :param only: the methods to show (default: all).
    """
    lines = ["| run | dataset | pair | " + " | ".join(h for _, h, *_ in DIFFERENCES) + " |",
             "|---" * (len(DIFFERENCES) + 3) + "|"]
    notes = []
    for name, page in SUMMARY_RUNS.items():
        payload = json.loads((RESULTS / name / "results.json").read_text())
        datasets = list(dict.fromkeys(r["dataset"] for r in payload["records"]))
        lines += differences_table(payload["records"], datasets, with_run=f"[{name}]({link.format(page=page)})",
                                   only=only)
        notes += collapsed_seeds(payload["records"], datasets, only)
    lines += ["", "Method minus base, mean ± std over seeds (seeds where the method is better / seeds); lower NLL, "
              "ECE and λ_max are better. Generated by `python scripts/results_pages.py` from `results/*/results.json`."]
    if notes:
        lines += ["", f"A seed on which the method lost {COLLAPSE_POINTS:g} accuracy points or more to its base "
                  "dominates its row:", "", *[f"* {note}" for note in notes]]
    return "\n".join(lines)


def _setting_values(settings: tuple[tuple[str, str, str], ...], dataset: str) -> dict[str, dict[int, dict]]:
    """``{setting: {seed: metrics and fit time}}`` of every setting of ``settings`` on ``dataset``."""
    values = {}
    for setting, run, method in settings:
        records = json.loads((RESULTS / run / "results.json").read_text())["records"]
        values[setting] = {r["seed"]: r["metrics"] | {"fit_seconds": r["fit_seconds"]} for r in records
                           if r["dataset"] == dataset and r["method"] == method}
    return values


def _mean_std_cell(values: list[float], fmt: str) -> str:
    spread = "" if len(values) < 2 else " ± " + fmt.format(statistics.stdev(values))
    return fmt.format(statistics.mean(values)) + spread


def _cheaper_steps_table(settings: tuple[tuple[str, str, str], ...], dataset: str) -> list[str]:
    """One family's settings on ``dataset``: each setting's metrics over the seeds it shares with the base and the full
    method, the share of the full method's λ_max reduction it keeps and its NLL against the full method's, paired by
    seed."""
    values = _setting_values(settings, dataset)
    (base, _, _), (full, _, _) = settings[:2]

    def column(setting: str, key: str, seeds: list[int]) -> list[float]:
        return [values[setting][s][key] for s in seeds]

    def reduction(setting: str, seeds: list[int]) -> float:
        """The mean over ``seeds`` of base − setting λ_max."""
        return statistics.mean(b - x for b, x in zip(column(base, "lambda_max", seeds),
                                                     column(setting, "lambda_max", seeds), strict=True))

    lines = [f"**{dataset}**, mean ± std over seeds:", "",
             "| setting | seeds | acc (%) | NLL | ECE | λ_max | fit (s) | λ_max reduction kept | NLL − full | "
             f"≥ {KEPT_REDUCTION:.0%} kept and NLL within noise |", "|---" * 10 + "|"]
    for setting, _, _ in settings:
        seeds = sorted(set(values[base]) & set(values[full]) & set(values[setting]))
        cells = [str(len(seeds)), _mean_std_cell([100 * a for a in column(setting, "acc", seeds)], "{:.2f}"),
                 _mean_std_cell(column(setting, "nll", seeds), "{:.4f}"),
                 _mean_std_cell(column(setting, "ece", seeds), "{:.4f}"),
                 _mean_std_cell(column(setting, "lambda_max", seeds), "{:.3g}"),
                 _mean_std_cell(column(setting, "fit_seconds", seeds), "{:.1f}")]
        if setting == base:
            cells += ["–", "–", "–"]
        elif setting == full:
            cells += ["100%", "–", "–"]
        else:
            kept = reduction(setting, seeds) / reduction(full, seeds)
            nll = [x - f for x, f in zip(column(setting, "nll", seeds), column(full, "nll", seeds), strict=True)]
            noise = statistics.stdev(column(full, "nll", seeds)) if len(seeds) > 1 else float("nan")
            within = statistics.mean(nll) <= noise  # worse by no more than the noise (better is fine)
            verdict = "yes" if kept >= KEPT_REDUCTION and within else "no"
            cells += [f"{kept:.0%}", _difference_cell(nll, "{:+.4f}", True),
                      f"{verdict} ({kept:.0%} kept; NLL {'within noise' if within else 'worse beyond noise'})"]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def cheaper_steps_section() -> str:
    """The cheaper sharpness-aware steps of every family of :data:`CHEAPER_STEP_RUNS` against the full method and the
    base, paired by seed."""
    runs = dict.fromkeys(run for settings in CHEAPER_STEP_RUNS.values() for _, run, _ in settings)
    payloads = [json.loads((RESULTS / run / "results.json").read_text()) for run in runs]
    configs = [{k: v for k, v in p["config"].items() if k != "options"} for p in payloads]
    if any(c != configs[0] for c in configs):
        raise ValueError(f"the runs of {CHEAPER_STEPS} differ in more than their options: {configs}")
    datasets = list(dict.fromkeys(r["dataset"] for r in payloads[0]["records"]))
    lines = ["Commands:", "", *[f"* `{p['command'].replace(' --no-progress', '')}`" for p in payloads], "",
             f"Configuration: {_config_line(payloads[0]['config'])}; the runs differ only in their options.", ""]
    for family, settings in CHEAPER_STEP_RUNS.items():
        lines += [f"*{family}*", ""]
        for dataset in datasets:
            lines += _cheaper_steps_table(settings, dataset)
    lines += [
        "Each row is over the seeds its setting shares with the base and the full method (seeds: their number). "
        "λ_max reduction kept: the mean over those seeds of (base − setting) λ_max over the mean of (base − full) "
        "λ_max, each seed's setting paired with the base and the full method of the same seed. NLL − full: the "
        "setting's NLL minus the full method's, paired by seed, mean ± std (seeds where the setting is lower / "
        "seeds). NLL within noise: that mean difference is below (better) or above by no more than the seed-to-seed "
        "standard deviation of the full method's NLL over the same seeds. Fit times are indicative (the machine was "
        "shared; the step costs are measured in `benchmarks/results/efficient_sam_steps.md`). Generated by "
        "`python scripts/results_pages.py` from the runs' `results.json`."]
    return "\n".join(lines)


def section(source: str, page: Path) -> str:
    """The generated text of ``source`` (a declared run, a benchmark's Markdown file or the summary) on ``page``."""
    if source == SUMMARY:
        folder = _link(DOCS / "methods", page)
        return summary("{page}.md" if folder == "." else folder + "/{page}.md")
    if source == CHEAPER_STEPS:
        return cheaper_steps_section()
    path = ROOT / source
    relative = path.relative_to(RESULTS).as_posix() if path.is_relative_to(RESULTS) else None
    if path.name == "results.json" and path.parent.relative_to(RESULTS).as_posix() in HARNESS_RUNS:
        return harness_section(path, page)
    if relative in TRANSFER_RUNS:
        return transfer_section(path)
    if path.suffix == ".md" and relative is not None and path.is_file():
        return markdown_section(path, page)
    raise ValueError(f"{page.relative_to(ROOT)} shows {source!r}, which is neither a declared run (HARNESS_RUNS, "
                     "TRANSFER_RUNS), the summary, the cheaper steps' comparison, nor a Markdown file under results/")


def render(page: Path, text: str | None = None) -> str:
    """``page``'s text with every generated section written from its source."""
    text = page.read_text() if text is None else text

    def fill(match: re.Match) -> str:
        source = match.group(1)
        return f"{BEGIN_MARK.format(source=source)}\n\n{section(source, page)}\n\n{END_MARK}"

    return SECTION.sub(fill, text)


def sources(page: Path) -> list[str]:
    """The sources of ``page``'s generated sections."""
    return SECTION.findall(page.read_text())


def doc_pages() -> list[Path]:
    """The documentation pages that show generated sections."""
    return sorted(p for p in DOCS.glob("**/*.md") if "_build" not in p.parts and sources(p))


def pages() -> dict[Path, str]:
    """``{path: text}`` of every page with generated sections."""
    return {page: render(page) for page in doc_pages()}


def readme_with_summary(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + START + "\n" + summary("docs/methods/{page}.md", README_METHODS) + "\n" + END + tail


def figures() -> list[Path]:
    """Redraw ``results/<run>/flat_vs_base_<dataset>.png`` of every declared harness run from its JSON."""
    written = []
    for run in harness_runs():
        records = json.loads(run.read_text())["records"]
        for dataset in dict.fromkeys(r["dataset"] for r in records):
            path = run.parent / f"flat_vs_base_{dataset}.png"
            if plot_flat_vs_base(path, records, dataset):
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", action="store_true", help="also redraw the flat-vs-base figures")
    args = parser.parse_args(argv)
    for path, text in pages().items():
        path.write_text(text)
        print("wrote", path.relative_to(ROOT))
    readme = README.read_text()
    if START in readme and END in readme:
        README.write_text(readme_with_summary(readme))
    if args.figures:
        for path in figures():
            print("drew", path.relative_to(ROOT))


if __name__ == "__main__":
    main()

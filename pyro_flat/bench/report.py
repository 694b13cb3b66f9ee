"""Tables (mean ± std over seeds), JSON and reliability-diagram plots of harness runs."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyro
import torch

from ..data import ClassificationData
from .config import RunConfig
from .loop import atomic_write_text
from .registry import METHODS
from .runner import RunRecord

COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (metric key, header, format)
    ("acc", "acc (%)", "{:.2f}"),
    ("nll", "NLL", "{:.4f}"),
    ("ece", "ECE", "{:.4f}"),
    ("brier", "Brier", "{:.4f}"),
    ("ood_auroc_entropy", "OOD AUROC", "{:.3f}"),
    ("lambda_max", "λ_max", "{:.3g}"),
    ("fit_seconds", "fit (s)", "{:.1f}"),
)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarise(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per (dataset, method): mean and sample standard deviation over seeds of every metric."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.dataset, r.method), []).append(r)
    rows = []
    for (dataset, method), rs in groups.items():
        row: dict[str, Any] = {"dataset": dataset, "method": method, "seeds": [r.seed for r in rs]}
        keys = list(rs[0].metrics) + ["fit_seconds"]
        for key in keys:
            values = [r.fit_seconds if key == "fit_seconds" else r.metrics[key] for r in rs]
            if key == "acc":
                values = [100 * v for v in values]
            row[key] = _mean_std(values)
        rows.append(row)
    return rows


def markdown_table(records: Sequence[RunRecord]) -> str:
    """A markdown table, one block per dataset; std over seeds after ±."""
    return summary_table(summarise(records))


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of :func:`summarise`'s rows (or the ``summary`` of a ``results.json``)."""
    lines = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        seeds = next(r["seeds"] for r in rows if r["dataset"] == dataset)
        lines.append(f"**{dataset}** ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}: {seeds})\n")
        lines.append("| method | " + " | ".join(h for _, h, _ in COLUMNS) + " |")
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for row in (r for r in rows if r["dataset"] == dataset):
            cells = []
            for key, _, fmt in COLUMNS:
                if key not in row:
                    cells.append("–")
                    continue
                mean, std = row[key]
                cells.append(fmt.format(mean) + ("" if math.isnan(std) else " ± " + fmt.format(std)))
            lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def record_dict(r: RunRecord) -> dict[str, Any]:
    """One seed's record as JSON: dataset, method, seed, fit time, metrics, training losses and per-epoch entries."""
    return {
        "dataset": r.dataset,
        "method": r.method,
        "seed": r.seed,
        "fit_seconds": r.fit_seconds,
        "metrics": r.metrics,
        "losses": r.info.get("losses", []),
        "epochs": r.entries,
    }


def write_json(path: Path, records: Sequence[RunRecord], config: RunConfig, command: str) -> None:
    """Every per-seed record, the summary, the configuration and the environment, as JSON."""
    payload = {
        "command": command,
        "config": config.to_dict(),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyro": pyro.__version__,
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "methods": {m: METHODS[m].description for m in dict.fromkeys(r.method for r in records)},
        "records": [record_dict(r) for r in records],
        "summary": summarise(records),
    }
    atomic_write_text(path, json.dumps(payload, indent=1))


def plot_curves(path: Path, records: Sequence[RunRecord]) -> None:
    """The per-epoch mean training loss of one dataset's runs, one panel per method (the methods' losses have
    different scales: full-data ELBOs, mean losses) with a line per seed and training phase, as PNG; nothing is
    written when no record has epoch entries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [r for r in records if any(e.get("loss") is not None for e in r.entries)]
    if not curves:
        return
    methods = list(dict.fromkeys(r.method for r in curves))
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for ax, method in zip(axes.flat, methods, strict=False):
        for r in (r for r in curves if r.method == method):
            for phase in dict.fromkeys(e["phase"] for e in r.entries):
                points = [(e["epoch"], e["loss"]) for e in r.entries if e["phase"] == phase and e["loss"] is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), marker=".", label=f"seed {r.seed}, phase {phase}")
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("epoch", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.suptitle(f"{curves[0].dataset}: mean training loss per step, by epoch", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_reliability(
    path: Path, records: Sequence[RunRecord], data: ClassificationData | None = None, num_bins: int = 15
) -> None:
    """One reliability diagram per method (first seed) for one dataset, side by side, saved as PNG (the labels are
    the records' ``test_labels``, or ``data.y_test``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..metrics import reliability_diagram

    firsts: dict[str, RunRecord] = {}
    for r in records:
        if r.test_probs is not None:
            firsts.setdefault(r.method, r)
    if not firsts:
        return
    cols = min(4, len(firsts))
    rows = math.ceil(len(firsts) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    first = next(iter(firsts.values()))
    y = (first.test_labels if data is None else data.y_test).cpu()
    for ax, (method, r) in zip(axes.flat, firsts.items(), strict=False):
        reliability_diagram(r.test_probs, y, num_bins=num_bins, ax=ax, label=method)
        ax.set_title(f"{r.dataset}: {method}")
    for ax in list(axes.flat)[len(firsts) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FLAT_VS_BASE_METRICS: tuple[tuple[str, str], ...] = (
    ("acc", "accuracy (%)"),
    ("nll", "NLL"),
    ("ece", "ECE"),
    ("ood_auroc_entropy", "OOD AUROC"),
    ("lambda_max", "λ_max"),
)


def flat_base_pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """``(flat, base)`` for every method in ``methods`` whose registered baseline is also in ``methods``."""
    present = set(methods)
    return [(m, METHODS[m].baseline) for m in methods if m in METHODS and METHODS[m].baseline in present]


def plot_flat_vs_base(path: Path, records: Sequence[dict[str, Any]], dataset: str) -> bool:
    """Each flat method against its base on ``dataset``, per seed and per metric, saved as PNG.

    One row per (flat, base) pair of the run, one column per metric; in each panel a line per seed joins the base's
    value (left) to the flat method's (right). ``records`` are the per-seed records of a ``results.json``
    (:func:`record_dict`). Returns ``False`` (and writes nothing) when the run has no pair on ``dataset``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["dataset"] == dataset]
    pairs = flat_base_pairs(list(dict.fromkeys(r["method"] for r in rows)))
    if not pairs:
        return False
    value = {(r["method"], r["seed"]): r["metrics"] for r in rows}
    cols = len(FLAT_VS_BASE_METRICS)
    fig, axes = plt.subplots(len(pairs), cols, figsize=(2.3 * cols, 1.9 * len(pairs)), squeeze=False)
    for (flat, base), panel_row in zip(pairs, axes, strict=True):
        seeds = sorted(s for m, s in value if m == flat and (base, s) in value)
        for (key, label), ax in zip(FLAT_VS_BASE_METRICS, panel_row, strict=True):
            scale = 100.0 if key == "acc" else 1.0
            for seed in seeds:
                a, b = value[base, seed].get(key), value[flat, seed].get(key)
                if a is not None and b is not None:
                    ax.plot([0, 1], [scale * a, scale * b], "o-", color="C0", alpha=0.7, markersize=3)
            ax.set_xticks([0, 1], [base, flat], fontsize=7)
            ax.set_xlim(-0.3, 1.3)
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(label, fontsize=8)
    fig.suptitle(f"{dataset}: each flat method (right) against its base (left), one line per seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

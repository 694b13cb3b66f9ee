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
from .files import atomic_write_text
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
    """One row per (dataset, method): mean and sample standard deviation over the seeds that finished of every
    metric; ``failed`` lists the seeds whose job failed (a row with no metric when every seed failed)."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.dataset, r.method), []).append(r)
    rows = []
    for (dataset, method), group in groups.items():
        rs = [r for r in group if r.error is None]
        row: dict[str, Any] = {"dataset": dataset, "method": method, "seeds": [r.seed for r in rs],
                               "failed": [r.seed for r in group if r.error is not None]}
        keys = list(rs[0].metrics) + ["fit_seconds"] if rs else []
        for key in keys:
            values = [r.fit_seconds if key == "fit_seconds" else r.metrics[key] for r in rs]
            if key == "acc":
                values = [100 * v for v in values]
            row[key] = _mean_std(values)
        rows.append(row)
    return rows


def markdown_table(records: Sequence[RunRecord]) -> str:
    """A markdown table, one block per dataset; std over seeds after ±; a failed job is marked in its method's cell
    and its reason listed under the table."""
    table = summary_table(summarise(records))
    failed = [r.error for r in records if r.error is not None]
    return table + "".join(f"\n* {reason}" for reason in failed) + ("\n" if failed else "")


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of :func:`summarise`'s rows (or the ``summary`` of a ``results.json``)."""
    lines = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        seeds = sorted({s for r in rows if r["dataset"] == dataset for s in r["seeds"] + r.get("failed", [])})
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
            failed = row.get("failed", [])
            mark = "" if not failed else (" (failed)" if not row["seeds"] else
                                          f" (seed{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                                          "failed)")
            lines.append(f"| {row['method']}{mark} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def record_dict(r: RunRecord) -> dict[str, Any]:
    """One seed's record as JSON: dataset, method, seed, fit time, metrics, training losses and per-epoch entries,
    and for a failed job why (``error``)."""
    return {
        "dataset": r.dataset,
        "method": r.method,
        "seed": r.seed,
        "fit_seconds": r.fit_seconds,
        "metrics": r.metrics,
        "losses": r.info.get("losses", []),
        "epochs": r.entries,
    } | ({} if r.error is None else {"error": r.error})


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


LOSS_LABELS = {
    "svi": "−ELBO, full data (SVI loss)",
    "svi (DDP)": "−ELBO, full data (SVI loss)",
    "SAM": "−log joint / N, minibatch",
    "BayesianSAM": "mean NLL, minibatch",
}
"""What the loss of each kind of training loop is (``entry["loop"]``, the loop's name): the losses of the methods
differ in scale by orders of magnitude, so each panel says which one it shows."""


def plot_curves(path: Path, records: Sequence[RunRecord]) -> bool:
    """The per-epoch mean training loss of one dataset's runs, as PNG: one panel per method with its own y axis
    labelled with what the loss is (:data:`LOSS_LABELS`: full-data −ELBOs and per-datum losses differ by orders of
    magnitude), a colour per training phase (an ensemble's members, HWA's pre-training and cycles) and a line per
    seed; the methods that log no loss (the samplers) are named under the panels. Returns ``False`` (and writes
    nothing) when no record has a loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    curves = [r for r in records if any(e.get("loss") is not None for e in r.entries)]
    if not curves:
        return False
    methods = list(dict.fromkeys(r.method for r in curves))
    silent = [m for m in dict.fromkeys(r.method for r in records) if m not in methods]
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.7 * rows + 0.6), squeeze=False, layout="constrained")
    for ax, method in zip(axes.flat, methods, strict=False):
        runs = [r for r in curves if r.method == method]
        phases = list(dict.fromkeys(e["phase"] for r in runs for e in r.entries if e.get("loss") is not None))
        loops = {e.get("loop") for r in runs for e in r.entries if e.get("loss") is not None}
        for r in runs:
            for i, phase in enumerate(phases):
                points = [(e["epoch"], e["loss"]) for e in r.entries if e["phase"] == phase and e["loss"] is not None]
                if points:
                    label = f"phase {phase}" if len(phases) > 1 and r is runs[0] else None
                    ax.plot(*zip(*points, strict=True), color=f"C{i % 10}", alpha=0.8, linewidth=1, marker=".",
                            markersize=4, label=label)
        ax.set_title(f"{method} ({len(runs)} seed{'s' if len(runs) > 1 else ''})", fontsize=9)
        ax.set_xlabel("epoch of the phase", fontsize=8)
        ax.set_ylabel(LOSS_LABELS.get(loops.pop(), "training loss") if len(loops) == 1 else "training loss",
                      fontsize=8)
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        if len(phases) > 1:
            ax.legend(fontsize=6, ncol=2, title="colour: phase", title_fontsize=6)
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.suptitle(f"{curves[0].dataset}: mean training loss per epoch; a line per seed, a colour per training phase "
                 "(an ensemble's members; HWA's pre-training, then its cycles)", fontsize=10)
    if silent:
        fig.supxlabel("no loss logged (samplers record draws, not a loss): " + ", ".join(silent), fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_reliability(
    path: Path, records: Sequence[RunRecord], data: ClassificationData | None = None, num_bins: int = 15
) -> bool:
    """One reliability diagram per method (first seed) for one dataset, side by side, saved as PNG (the labels are
    the records' ``test_labels``, or ``data.y_test``). Returns ``False`` (and writes nothing) when no record kept its
    test probabilities."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..metrics import reliability_diagram

    firsts: dict[str, RunRecord] = {}
    for r in records:
        if r.test_probs is not None:
            firsts.setdefault(r.method, r)
    if not firsts:
        return False
    cols = min(4, len(firsts))
    rows = math.ceil(len(firsts) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 4.0 * rows), squeeze=False, layout="constrained")
    first = next(iter(firsts.values()))
    y = (first.test_labels if data is None else data.y_test).cpu()
    for ax, (method, r) in zip(axes.flat, firsts.items(), strict=False):
        reliability_diagram(r.test_probs, y, num_bins=num_bins, ax=ax)
        ax.set_title(f"{method} (seed {r.seed})", fontsize=9)
    for ax in list(axes.flat)[len(firsts) :]:
        ax.axis("off")
    fig.suptitle(f"{first.dataset}: reliability of the BMA on the test set", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


FLAT_VS_BASE_METRICS: tuple[tuple[str, str, float, bool], ...] = (
    # (metric key, label, scale, lower is better)
    ("acc", "accuracy (points)", 100.0, False),
    ("nll", "NLL", 1.0, True),
    ("ece", "ECE", 1.0, True),
    ("ood_auroc_entropy", "OOD AUROC", 1.0, False),
    ("lambda_max", "λ_max", 1.0, True),
)


def flat_base_pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """``(method, base)`` for every method in ``methods`` whose registered baseline is also in ``methods``.

    Most are a flat method and its base (``f_swag``, ``swag``), but not all: ``swag`` and ``swa`` are compared with
    ``map``, ``vi_cyclical`` with ``vi``, ``csgld`` with ``sgld``. What shows the pairs names them as method − base."""
    present = set(methods)
    return [(m, METHODS[m].baseline) for m in methods if m in METHODS and METHODS[m].baseline in present]


FLAT_VS_BASE_MARGIN = 1.3
"""The half-width of a flat-vs-base panel over the largest distance from 0 of a seed or a mean ± sd bar: the farthest
marker sits at 77 % of the half-width, clear of the frame."""


def plot_flat_vs_base(path: Path, records: Sequence[dict[str, Any]], dataset: str) -> bool:
    """Each method minus its base (:func:`flat_base_pairs`) on ``dataset``, per seed and per metric, saved as PNG.

    One compact panel per metric (:data:`FLAT_VS_BASE_METRICS`), the pairs of the run in rows on a shared axis, each
    named ``method − base`` (not every method compared with a base is a flat one: ``swag − map``): a dot per seed for
    method − base on that seed, a diamond with a bar for the mean ± standard deviation over seeds, a line at 0 (no
    difference) and the side where the method is better shaded. Each panel is symmetric about 0 and wide enough that
    every dot and bar sits inside it (:data:`FLAT_VS_BASE_MARGIN`). ``records`` are the per-seed records of a
    ``results.json`` (:func:`record_dict`). Returns ``False`` (and writes nothing) when the run has no pair on
    ``dataset``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in records if r["dataset"] == dataset]
    pairs = flat_base_pairs(list(dict.fromkeys(r["method"] for r in rows)))
    if not pairs:
        return False
    value = {(r["method"], r["seed"]): r["metrics"] for r in rows}
    metrics = [m for m in FLAT_VS_BASE_METRICS if any(m[0] in v for v in value.values())]
    # sized to be read where the documentation shows it (about 750 px wide) as well as at full size
    fig, axes = plt.subplots(1, len(metrics), figsize=(1.45 * len(metrics) + 1.4, 1.5 + 0.27 * len(pairs)),
                             sharey=True, squeeze=False, layout="constrained")
    positions = range(len(pairs))[::-1]  # the first pair on top
    for (key, label, scale, lower_is_better), ax in zip(metrics, axes[0], strict=True):
        reach = 0.0  # the largest distance from 0 of a dot or a bar's end
        for (method, base), y in zip(pairs, positions, strict=True):
            diffs = [scale * (value[method, s][key] - value[base, s][key]) for m, s in value
                     if m == method and (base, s) in value and value[method, s].get(key) is not None
                     and value[base, s].get(key) is not None]
            if not diffs:
                continue
            ax.plot(diffs, [y] * len(diffs), "o", color="0.45", markersize=3, alpha=0.7, zorder=3)
            mean = sum(diffs) / len(diffs)
            std = 0.0 if len(diffs) < 2 else math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
            ax.errorbar([mean], [y], xerr=[std], fmt="D", color="black", markersize=4, capsize=2, zorder=4)
            reach = max(reach, *(abs(d) for d in diffs), abs(mean) + std)
        limit = FLAT_VS_BASE_MARGIN * reach or 1.0
        ax.set_xlim(-limit, limit)
        ax.axvspan(-limit if lower_is_better else 0, 0 if lower_is_better else limit, color="tab:green", alpha=0.08)
        ax.axvline(0, color="0.3", linewidth=0.8)
        arrow = "← method better" if lower_is_better else "method better →"
        ax.set_xlabel(f"method − base\n{arrow}", fontsize=7)
        ax.set_title(label, fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=3, symmetric=True))
        ax.tick_params(labelsize=6)
        ax.grid(axis="y", color="0.9", linewidth=0.5)
    axes[0][0].set_yticks(list(positions), [f"{method} − {base}" for method, base in pairs], fontsize=6.5)
    axes[0][0].set_ylim(-0.7, len(pairs) - 0.3)
    fig.suptitle(f"{dataset}: each method minus its base (the method it is compared with); dots: seeds, diamond: "
                 "mean ± sd", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

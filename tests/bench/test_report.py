"""The harness's figures say what they show: each pair named as what it is, every marker inside its panel, and the
reliability diagrams' legends clear of the axis labels (window extents after a draw)."""

from __future__ import annotations

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from pyro_flat.bench import methods  # noqa: E402, F401  (fills the registry)
from pyro_flat.bench.registry import METHODS  # noqa: E402
from pyro_flat.bench.report import plot_flat_vs_base, plot_reliability  # noqa: E402
from pyro_flat.bench.runner import RunRecord  # noqa: E402


def _record(method, seed, acc, lambda_max=2.0):
    return {"dataset": "digits", "method": method, "seed": seed, "fit_seconds": 1.0,
            "metrics": {"acc": acc, "nll": 1 - acc, "ece": 0.1, "ood_auroc_entropy": 0.5, "lambda_max": lambda_max}}


def _drawn(monkeypatch, tmp_path, plot, *args):
    """The figure ``plot`` draws (``savefig`` and ``close`` caught), drawn, and its renderer."""
    figures = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    monkeypatch.setattr(plt, "close", lambda fig: None)
    assert plot(tmp_path / "figure.png", *args)
    (fig,) = figures
    fig.canvas.draw()
    return fig, fig.canvas.get_renderer()


def _texts(fig):
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]


def test_flat_vs_base_names_each_pair_as_what_it_is(tmp_path, monkeypatch):
    # swag is compared with map, as f_swag with swag, yet swag is no flat method (SWAG is the sharp-basin baseline)
    assert METHODS["swag"].baseline == "map" and METHODS["f_swag"].baseline == "swag"
    accs = {"map": 0.90, "swag": 0.92, "f_swag": 0.97}
    records = [_record(m, s, a + 0.001 * s) for s in range(3) for m, a in accs.items()]
    fig, _ = _drawn(monkeypatch, tmp_path, plot_flat_vs_base, records, "digits")
    acc = fig.axes[0]
    rows = {t.get_position()[1]: t.get_text() for t in acc.get_yticklabels()}
    assert [rows[y] for y in sorted(rows, reverse=True)] == ["swag − map", "f_swag − swag"]
    for y, name in rows.items():  # the row named "a − b" shows a − b, per seed, in points
        method, base = name.split(" − ")
        seeds = [x for line in acc.get_lines() if line.get_marker() == "o" and set(line.get_ydata()) == {y}
                 for x in line.get_xdata()]
        assert seeds == pytest.approx([100 * (accs[method] - accs[base])] * 3)
    # no text calls the methods flat: not every row is a flat method and its base
    assert not [text for text in _texts(fig) if "flat" in text]


@pytest.mark.parametrize("seeds", [1, 2, 5])
def test_flat_vs_base_markers_sit_inside_their_panels(tmp_path, monkeypatch, seeds):
    # one seed: the marker is the extreme; two: the mean + sd bar reaches past the farthest seed
    lambdas = [1.0, 9.0, 4.0, 3.0, 2.5][:seeds]
    records = [r for s in range(seeds)
               for r in (_record("map", s, 0.9), _record("sam", s, 0.95 + 0.01 * s, 2 + lambdas[s]))]
    fig, renderer = _drawn(monkeypatch, tmp_path, plot_flat_vs_base, records, "digits")
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        clearance = 0.05 * frame.width  # every marker and bar at least 5 % of the panel's width from its frame
        marks = [line.get_window_extent(renderer) for line in ax.get_lines() if line.get_marker() not in ("None", "")]
        marks += [bars.get_window_extent(renderer) for bars in ax.collections]
        assert marks
        for box in marks:
            assert frame.x0 + clearance <= box.x0 and box.x1 <= frame.x1 - clearance, (ax.get_title(), box, frame)
            assert frame.y0 < box.y0 and box.y1 < frame.y1


def test_reliability_figure_legends_sit_under_the_axis_labels(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (400,), generator=g)
    records = []
    for method in ("map", "vi", "mc_dropout", "ensemble", "sgld"):  # two rows of panels
        logits = 3 * torch.nn.functional.one_hot(y, 10) + 2 * torch.randn(400, 10, generator=g)
        records.append(RunRecord("digits", method, 0, {}, 1.0, test_probs=logits.softmax(-1), test_labels=y))
    fig, renderer = _drawn(monkeypatch, tmp_path, plot_reliability, records)
    panels = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(panels) == 5
    others = [t.get_window_extent(renderer) for ax in panels for t in (ax.title, ax.xaxis.label)]
    for ax in panels:
        legend = ax.get_legend().get_window_extent(renderer)
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert not [box for box in [*others, *ticks] if box.overlaps(legend)]  # its own labels and the next row's
        assert not legend.overlaps(ax.get_window_extent(renderer))
        for text in ax.get_legend().get_texts():
            box = text.get_window_extent(renderer)
            assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)

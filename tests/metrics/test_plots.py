"""reliability_diagram draws with the Agg backend and imports matplotlib lazily."""

from __future__ import annotations

import io
import sys

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pyro_flat.metrics import (  # noqa: E402
    bma_probs,
    expected_calibration_error,
    reliability_bins,
    reliability_diagram,
)

from .conftest import make_problem  # noqa: E402


def test_reliability_diagram_returns_a_figure_with_the_ece():
    logits, y = make_problem()
    probs = bma_probs(logits)
    fig = reliability_diagram(probs, y, num_bins=10, label="BMA")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    ece = float(expected_calibration_error(probs, y, 10))
    assert f"BMA: ECE = {ece:.4f} (10 bins)" in texts
    assert "perfect calibration" in texts
    assert len(ax.patches) == int((reliability_bins(probs, y, 10)["counts"] > 0).sum())  # one bar per filled bin
    fig.savefig(io.BytesIO(), format="png")  # renders without a display


@pytest.mark.parametrize("seed", range(4))
def test_reliability_legend_covers_no_bar(seed):
    # under-confident predictions fill the top-left bins, where a legend inside the axes used to sit
    logits, y = make_problem(seed=seed)
    fig = reliability_diagram(bma_probs(0.3 * logits), y, label="tempered")
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert ax.patches and not [bar for bar in ax.patches if bar.get_window_extent(renderer).overlaps(legend)]
    assert not legend.overlaps(ax.get_window_extent(renderer))
    assert_legend_clear_of_the_x_axis(ax, renderer)
    for text in ax.get_legend().get_texts():  # and it is drawn inside the figure
        box = text.get_window_extent(renderer)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)


def assert_legend_clear_of_the_x_axis(ax, renderer):
    """``ax``'s legend overlaps neither its x label nor its x tick labels (window extents after a draw)."""
    legend = ax.get_legend().get_window_extent(renderer)
    label = ax.xaxis.label.get_window_extent(renderer)
    assert ax.xaxis.label.get_text() and not legend.overlaps(label), (legend, label)
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert ticks and not [box for box in ticks if box.overlaps(legend)]


@pytest.mark.parametrize(("size", "dpi"), [((3.2, 3.7), 100), ((4.5, 5.0), 72), ((8.0, 8.0), 200)])
def test_reliability_legend_sits_under_the_axis_label(size, dpi):
    logits, y = make_problem()
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    for scale, name in [(1.0, "a"), (0.3, "tempered")]:  # two legend entries and the diagonal's
        reliability_diagram(bma_probs(scale * logits), y, ax=ax, label=name)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    assert_legend_clear_of_the_x_axis(ax, renderer)
    for text in ax.get_legend().get_texts():  # kept in the figure by the layout
        box = text.get_window_extent(renderer)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)


def test_reliability_diagram_overlays_on_given_axes():
    fig, ax = plt.subplots()
    try:
        for seed, name in [(0, "a"), (1, "b")]:
            logits, y = make_problem(seed=seed)
            assert reliability_diagram(bma_probs(logits), y, ax=ax, label=name) is fig
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels.count("perfect calibration") == 1
        assert len(ax.get_legend().get_texts()) == 3
    finally:
        plt.close(fig)


def test_missing_matplotlib_names_the_extra(monkeypatch):
    logits, y = make_problem(num_points=20)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes `import matplotlib.figure` fail
    with pytest.raises(ImportError, match=r"pip install pyro_flat\[bench\]"):
        reliability_diagram(bma_probs(logits), y)

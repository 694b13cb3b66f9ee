"""Plots of calibration. matplotlib is an optional dependency (``pip install pyro_flat[bench]``), imported lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .calibration import reliability_bins

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.transforms import Transform

_DIAGONAL = "perfect calibration"


def reliability_diagram(
    probs: Tensor,
    y: Tensor,
    *,
    num_bins: int = 15,
    ax: Axes | None = None,
    label: str | None = None,
) -> Figure:
    r"""Reliability diagram: accuracy per confidence bin against the diagonal of perfect calibration.

    Draws one bar per non-empty bin of :func:`~pyro_flat.metrics.reliability_bins` (height :math:`\mathrm{acc}_b`,
    spanning the bin), the mean confidence :math:`\mathrm{conf}_b` of each bin as a marker and the diagonal
    :math:`\mathrm{acc}=\mathrm{conf}`; the legend gives the ECE (:func:`~pyro_flat.metrics.expected_calibration_error`
    with the same bins) and sits under the x-axis label, where it hides no bar and no label. Bars below the diagonal
    mean over-confidence. Several calls on one ``ax`` overlay methods.

    :param probs: BMA probabilities :math:`\bar p`, shape ``[N, C]``.
    :param y: labels, int64 of shape ``[N]``.
    :param int num_bins: number of equal-width bins, default 15.
    :param ax: matplotlib axes to draw on (the diagonal and axis labels are added on the first call); default a new
        :class:`matplotlib.figure.Figure` with constrained layout, not managed by pyplot (so nothing needs closing; in
        a notebook, show it by ending the cell with it). On axes of your own, lay the figure out with
        ``layout="constrained"`` or ``tight_layout()`` so that the legend under the axes is kept.
    :param str label: legend label of this curve, e.g. the method's name.
    :returns: the figure holding the axes.
    :raises ImportError: if matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("reliability_diagram needs matplotlib: pip install pyro_flat[bench]") from err

    bins = reliability_bins(probs, y, num_bins)
    weights = bins["counts"].to(bins["accuracy"].dtype) / bins["counts"].sum()
    ece = float((weights * (bins["accuracy"] - bins["confidence"]).abs()).sum())
    edges = bins["edges"].detach().cpu().tolist()
    counts = bins["counts"].cpu().tolist()
    accuracy = bins["accuracy"].detach().cpu().tolist()
    confidence = bins["confidence"].detach().cpu().tolist()
    filled = [b for b, n in enumerate(counts) if n > 0]

    if ax is None:
        ax = Figure(figsize=(4.5, 5.0), layout="constrained").add_subplot()
    if not any(line.get_label() == _DIAGONAL for line in ax.get_lines()):  # first diagram on these axes
        ax.plot([0, 1], [0, 1], linestyle="--", color="0.5", linewidth=1, label=_DIAGONAL)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")
        ax.set_anchor("S")  # squared at the bottom of its box, where a layout measured the legend under it
        ax.set_xlabel("confidence (max probability)")
        ax.set_ylabel("accuracy")
    text = f"ECE = {ece:.4f} ({num_bins} bins)"
    bars = ax.bar(
        [edges[b] for b in filled],
        [accuracy[b] for b in filled],
        width=[edges[b + 1] - edges[b] for b in filled],
        align="edge",
        alpha=0.6,
        edgecolor="black",
        linewidth=0.5,
        label=f"{label}: {text}" if label else text,
    )
    ax.plot(
        [confidence[b] for b in filled],
        [accuracy[b] for b in filled],
        marker="o",
        markersize=3,
        linestyle="none",
        color=bars.patches[0].get_facecolor(),
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=_under_x_label(ax), fontsize="small",
              frameon=False)
    return ax.figure


def _under_x_label(ax: Axes) -> Transform:
    """``ax``'s axes coordinates moved down past its x tick marks, tick labels and x label (in points, from their
    sizes), so that a legend hung from ``(0.5, 0)`` sits under the label at any figure size and dpi."""
    from matplotlib.transforms import offset_copy

    tick = ax.xaxis.get_major_ticks()[0]
    line = 1.2  # a line of text is about 1.2 font sizes high
    drop = (tick.get_tick_padding() + tick.get_pad() + line * tick.label1.get_fontsize() + ax.xaxis.labelpad
            + line * ax.xaxis.label.get_fontsize())
    return offset_copy(ax.transAxes, fig=ax.figure, y=-drop, units="points")


__all__ = ["reliability_diagram"]

"""``frontier.png`` of ``sweep --eval``: old-role against new-role validation score of every grid point.

θpost is the black star; the shaded band is where a point's old-role score is within τ of
θpost's (the points the rule may choose); the black line is the Pareto frontier, each of its
points labelled with its (λ, ρ) (a frontier of one point is its label alone: no line, and no
legend entry for one); the chosen point is ringed in red. Colour tells ρ, size tells λ, and
the legend keys both: one entry per ρ, one grey marker of each size per λ. Labels are placed
one by one at the first of several offsets where they overlap no earlier label, marker or the
axes' edge (the fewest overlaps when none is free), so they stay legible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

# Label offsets in points from the labelled marker, tried in this order (then farther, with a leader line).
OFFSETS = [(7, 6), (7, -12), (-7, 6), (-7, -12), (0, 12), (0, -18)]
OFFSETS += [(dx * 2.6, dy * 2.2) for dx, dy in OFFSETS]


@dataclass(frozen=True)
class PlotPoint:
    """One grid point's validation role scores."""

    lam: float
    rho: float
    old: float
    new: float


def _limits(values: list[float], pad: float = 0.08, least: float = 0.1) -> tuple[float, float]:
    """Axis limits around ``values`` with a margin, at least ``least`` wide."""
    low, high = min(values), max(values)
    middle, half = (low + high) / 2, max((high - low) * (1 + 2 * pad), least) / 2
    return middle - half, middle + half


def _place_labels(figure: Figure, axes, labelled: list[tuple[str, float, float, str]], obstacles: list[Bbox]) -> None:
    """Annotate each (text, x, y, colour) at the first offset whose box overlaps nothing placed so far."""
    renderer = figure.canvas.get_renderer()
    frame = axes.get_window_extent(renderer)
    placed = list(obstacles)
    for text, x, y, colour in labelled:
        best, best_cost = None, math.inf
        for dx, dy in OFFSETS:
            far = abs(dx) > 10 or abs(dy) > 15
            label = axes.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8,
                                  color=colour, fontweight="bold" if colour != "black" else "normal",
                                  ha="left" if dx > 0 else "right" if dx < 0 else "center",
                                  bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.7", alpha=0.85),
                                  arrowprops=dict(arrowstyle="-", color="0.5", lw=0.6) if far else None)
            box = label.get_window_extent(renderer).expanded(1.05, 1.1)
            cost = sum(box.overlaps(other) for other in placed) + (0 if frame.contains(box.x0, box.y0)
                                                                    and frame.contains(box.x1, box.y1) else 3)
            if cost < best_cost:
                if best is not None:
                    best[0].remove()
                best, best_cost = (label, box), cost
            else:
                label.remove()
            if cost == 0:
                break
        placed.append(best[1])


def _marker_boxes(figure: Figure, axes, xs: list[float], ys: list[float], radius: float = 4.0) -> list[Bbox]:
    """A small box (in display units) around every marker, which labels should not cover."""
    scale = figure.dpi / 72
    centres = axes.transData.transform(list(zip(xs, ys))) if xs else []
    return [Bbox.from_extents(x - radius * scale, y - radius * scale, x + radius * scale, y + radius * scale)
            for x, y in centres]


def _draw_points(axes, points: list[PlotPoint]) -> None:
    """Every point, coloured by ρ and sized by λ, with one legend entry per ρ and one per λ (its size, in grey)."""
    colours = {rho: f"C{index % 10}" for index, rho in enumerate(sorted({p.rho for p in points}))}
    lambdas = sorted({p.lam for p in points})
    size = {lam: 30 + 60 * index / max(1, len(lambdas) - 1) for index, lam in enumerate(lambdas)}
    for rho, colour in colours.items():
        chosen = [p for p in points if p.rho == rho]
        axes.scatter([p.new for p in chosen], [p.old for p in chosen], s=[size[p.lam] for p in chosen],
                     color=colour, alpha=0.75, edgecolors="white", linewidths=0.5, zorder=3,
                     label=f"ρ = {rho:g}")
    for lam in lambdas:  # the size key: nothing drawn on the axes, an entry in the legend
        axes.scatter([], [], s=size[lam], color="0.55", alpha=0.75, edgecolors="white", label=f"λ = {lam:g}")


def plot_frontier(path: Path, points: list[PlotPoint], post: tuple[float, float], frontier: list[int],
                  chosen: int | None, tolerance: float, failed: int = 0) -> Path:
    """Draw the sweep's validation scores to ``path`` (PNG); ``post`` is θpost's (old, new); indices into ``points``."""
    frontier_figure(points, post, frontier, chosen, tolerance, failed).savefig(path, format="png")
    return path


def frontier_figure(points: list[PlotPoint], post: tuple[float, float], frontier: list[int], chosen: int | None,
                    tolerance: float, failed: int = 0) -> Figure:
    """The figure :func:`plot_frontier` saves."""
    figure = Figure(figsize=(8, 6), dpi=130)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    post_old, post_new = post
    xs, ys = [p.new for p in points] + [post_new], [p.old for p in points] + [post_old]
    x_limits, y_limits = _limits(xs), _limits(ys + [post_old - tolerance])
    axes.set(xlim=x_limits, ylim=y_limits)
    axes.axhspan(max(post_old - tolerance, y_limits[0]), y_limits[1], color="tab:green", alpha=0.09, zorder=0,
                 label=f"old ≥ θpost − τ = {post_old - tolerance:.3f}")
    axes.axhline(post_old - tolerance, color="tab:green", lw=0.8, ls="--", zorder=1)
    _draw_points(axes, points)
    line = [points[i] for i in frontier]
    if len(line) > 1:  # one point makes no line: no legend entry for what is not drawn
        axes.plot([p.new for p in line], [p.old for p in line], color="black", lw=1.2, zorder=2,
                  label="Pareto frontier (λ, ρ)")
    axes.scatter([post_new], [post_old], marker="*", s=260, color="black", zorder=5, label="θpost")
    ring = (post_new, post_old) if chosen is None else (points[chosen].new, points[chosen].old)
    axes.scatter(*ring, s=420, facecolors="none", edgecolors="tab:red", linewidths=2, zorder=6,
                 label="chosen" + (" (θpost: none within τ)" if chosen is None else ""))
    note = f"; {failed} failed point{'s' * (failed != 1)} not shown" if failed else ""
    axes.set(xlabel="new-role score (validation)", ylabel="old-role score (validation)",
             title=f"sweep: {len(points)} points, τ = {tolerance:g}{note}")
    axes.grid(True, alpha=0.25)
    axes.legend(fontsize=8, loc="best", framealpha=0.9, title="colour: ρ, size: λ", title_fontsize=8)
    figure.tight_layout()
    labelled = [("chosen: θpost" if chosen is None else f"chosen ({points[chosen].lam:g}, {points[chosen].rho:g})",
                 *ring, "tab:red")]
    labelled += [(f"({p.lam:g}, {p.rho:g})", p.new, p.old, "black") for i, p in zip(frontier, line) if i != chosen]
    if chosen is not None:
        labelled.append(("θpost", post_new, post_old, "black"))
    obstacles = _marker_boxes(figure, axes, xs, ys) + _marker_boxes(figure, axes, [ring[0]], [ring[1]], radius=12)
    legend = axes.get_legend().get_window_extent(figure.canvas.get_renderer())
    _place_labels(figure, axes, labelled, obstacles + [legend])
    return figure

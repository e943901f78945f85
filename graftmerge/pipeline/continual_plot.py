"""matrix.png of ``graftmerge continual``: the score matrix as a heatmap, and each task's score across the steps."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _heatmap(axis, table: dict, tasks: list[str], title: str):
    """One table's test matrix (models × tasks), each cell written in."""
    image = axis.imshow(table["test"], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    axis.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=8)
    axis.set_yticks(range(len(table["models"])), table["models"], fontsize=8)
    for row, values in enumerate(table["test"]):
        for column, value in enumerate(values):
            axis.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7,
                      color="white" if value < 0.5 else "black")
    bwt = "n/a" if table["bwt"] is None else f"{table['bwt']:+.3f}"
    axis.set_title(f"{title}\nACC {table['average_accuracy']:.3f}, BWT {bwt}", fontsize=9)
    return image


def plot_matrix(path: Path, matrix: dict) -> None:
    """Write the picture to ``path`` (replaced whole): heatmaps of the graft (and baseline), per-task curves."""
    tables = [("continual graft", matrix)] + ([("task-arithmetic baseline", matrix["baseline"])]
                                            if "baseline" in matrix else [])
    figure = Figure(figsize=(5.5 * (len(tables) + 1), 4.5))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(tables) + 1, squeeze=False)
    image = None
    for axis, (title, table) in zip(axes[0], tables):
        image = _heatmap(axis, table, matrix["tasks"], title)
    figure.colorbar(image, ax=axes[0][: len(tables)].tolist(), fraction=0.03, label="normalised test score")
    curves = axes[0][-1]
    steps = range(len(matrix["models"]))
    for column, task in enumerate(matrix["tasks"]):
        line, = curves.plot(steps, [row[column] for row in matrix["test"]], marker="o", label=task)
        if "baseline" in matrix:
            curves.plot(steps, [row[column] for row in matrix["baseline"]["test"]], linestyle="--",
                        color=line.get_color(), alpha=0.6)
    curves.set_xticks(list(steps), matrix["models"], fontsize=8)
    curves.set_ylim(-0.02, 1.02)
    dashed = " (dashed: baseline)" if "baseline" in matrix else ""
    curves.set_title(f"each task's normalised test score across the steps{dashed}", fontsize=9)
    curves.legend(fontsize=7, loc="best")
    temporary = path.parent / f".{path.name}.tmp-{os.getpid()}.png"
    figure.savefig(temporary, dpi=110, bbox_inches="tight")
    os.replace(temporary, path)

"""The LM demo's results figure: Pareto frontiers per method, chosen points and paired differences with intervals.

Four panels, every label on an axis or in a legend (none placed next to a point, so none
overlap): (1) each method's Pareto frontier over its whole grid (test scores, each
configuration averaged over seeds), θpost marked and the value prior drawn as a line;
(2) the paired differences with their 95 % intervals, both tolerances; (3, 4) the chosen
point of every method at each tolerance: per-seed scores, mean and 95 % interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from experiments.demo.lm_reanalysis import POST, per_seed, reanalyse
from experiments.demo.lm_report import families, plot_compute
from experiments.demo.lm_settings import LmDemoSettings
from experiments.demo.lm_verdict import DONOR_QUESTION, choose_point, member_table
from experiments.paired_tests import paired_t
from graftmerge.math.frontier import pareto_frontier
from graftmerge.pipeline.frontier_plot import PlotPoint
from graftmerge.pipeline.frontier_plot import plot_frontier as plot_sweep_frontier

COLOURS = {"SFT": "tab:orange", "OPSD-forward": "tab:brown", "OPSD-reverse": "tab:purple", "graft": "tab:red"}
TOLERANCE_COLOURS = ("tab:blue", "tab:green", "tab:olive")
PRIOR_COLOUR = "tab:green"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both coordinates (ties kept once), sorted by the first ascending."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front[::-1]


def colour_of(name: str) -> str:
    """A method's colour: by its update method (SFT, each OPSD, graft)."""
    return next((c for prefix, c in COLOURS.items() if name.startswith(prefix)), "tab:gray")


def masked(name: str) -> bool:
    """Whether a method family may use masks ("… + mask", "graft", "graft@donor")."""
    return name.endswith("+ mask") or (name.startswith("graft") and "no mask" not in name)


def frontier_panels(settings: LmDemoSettings) -> dict[str, list[str]]:
    """Panel title → the method families drawn there: each update method unmasked and masked, then every masked."""
    panels = {"SFT of θpost": ["SFT + merge", "SFT + merge + mask"]}
    for kind in settings.opsd:
        panels[f"OPSD-{kind}"] = [f"OPSD-{kind} + merge", f"OPSD-{kind} + merge + mask"]
    panels["graft (donor chosen on validation)"] = ["graft, no mask", "graft"]
    panels["every masked method"] = ["SFT + merge + mask", *(f"OPSD-{k} + merge + mask" for k in settings.opsd),
                                     "graft"]
    return panels


def configuration_means(evaluated: dict[int, dict]) -> list[dict[str, Any]]:
    """Every configuration evaluated in every seed, its scores averaged over seeds."""
    keys = ("family", "learning_rate", "epochs", "lam", "mask", "rho")
    grouped: dict[tuple, list[dict]] = {}
    for result in evaluated.values():
        for point in result["points"]:
            grouped.setdefault(tuple(point[k] for k in keys), []).append(point)
    return [{**dict(zip(keys, key)), **{s: statistics.fmean(p[s] for p in points) for s in ("old_test", "new_test")}}
            for key, points in grouped.items() if len(points) == len(evaluated)]


def _prior_line(axis: Axes, priors: dict[int, dict]) -> None:
    values = [p["new_test"] for p in priors.values()]
    axis.axvline(statistics.fmean(values), color=PRIOR_COLOUR, linewidth=1.5,
                 label=f"value prior (most common value per relation), mean {statistics.fmean(values):.3f}")
    if len(values) > 1:
        axis.axvspan(min(values), max(values), color=PRIOR_COLOUR, alpha=0.12, label="value prior, range over seeds")


def plot_frontier(axis: Axes, analysis: dict[str, Any], means: list[dict], title: str, names: list[str]) -> None:
    """The Pareto frontiers of (new, old) test accuracy of ``names`` over their grids; θpost and the value prior."""
    members = families(analysis["settings"])
    post = {s: statistics.fmean(r["models"]["post"][s] for r in analysis["evaluated"].values())
            for s in ("old_test", "new_test")}
    for name in names:
        inside = [p for p in means if members[name](p)]
        axis.scatter([p["new_test"] for p in inside], [p["old_test"] for p in inside], s=5, color="0.8", zorder=1)
        front = pareto_front([(p["new_test"], p["old_test"]) for p in inside])
        axis.plot([x for x, _ in front], [y for _, y in front], drawstyle="steps-pre", marker="o", markersize=3,
                  color=colour_of(name), linestyle="-" if masked(name) else "--",
                  label=name, zorder=3)
    axis.plot(post["new_test"], post["old_test"], "*", color="black", markersize=12, zorder=4, label="θpost")
    _prior_line(axis, analysis["priors"])
    for tolerance, style in zip(analysis["chosen"], (":", "-.")):
        axis.axhline(post["old_test"] - float(tolerance), color="0.4", linestyle=style, linewidth=1,
                     label=f"θpost − {tolerance}")
    axis.set(ylim=(post["old_test"] - 0.12, 1.0), title=title, xlabel="new facts, test accuracy")
    lines = [line for line in axis.get_lines() if line.get_label() in names]
    axis.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="lower left")


def plot_frontiers(figure: Figure, place: Any, analysis: dict[str, Any]) -> None:
    """One small panel per update method (unmasked dashed, masked solid), then every masked method together."""
    means = configuration_means(analysis["evaluated"])
    panels = frontier_panels(analysis["settings"])
    axes = place.subgridspec(1, len(panels)).subplots(sharex=True, sharey=True)
    for axis, (title, names) in zip(axes, panels.items()):
        plot_frontier(axis, analysis, means, title, names)
    bottom = axes[0].get_ylim()[0]
    right = max(p["new_test"] for p in means if p["old_test"] >= bottom)
    axes[0].set(xlim=(0, min(1.0, right + 0.05)), ylabel="old task A, test accuracy")
    figure.suptitle(f"Pareto frontiers over each method's grid: test scores of every configuration, "
                f"mean over {len(analysis['evaluated'])} seed(s).\nDashed: unmasked; solid: masks allowed; grey: "
                "the configurations; star: θpost; green line and band: the value prior (mean, range over seeds); "
                "dotted / dash-dotted: θpost − τ (selection used validation)", fontsize=9, x=0.01, ha="left")


def _interval_row(axis: Axes, y: float, values: list[float], colour: str, marker: str = "o") -> None:
    """Per-seed values (small), their mean (large) and its 95 % interval (a line) at height ``y``."""
    axis.scatter(values, [y] * len(values), s=12, color="0.45", zorder=2)
    mean = statistics.fmean(values)
    if len(values) > 1:
        test = paired_t(values)
        axis.plot([test.low, test.high], [y, y], color=colour, linewidth=2, zorder=3)
    axis.plot(mean, y, marker, color=colour, markersize=8, zorder=4)


def plot_chosen(axis: Axes, analysis: dict[str, Any], tolerance: str) -> None:
    """The chosen point of every method at τ: per-seed new-task test scores, mean and 95 % interval."""
    table = analysis["chosen"][tolerance]
    names = [POST, *table]
    for row, name in enumerate(names):
        values = list(per_seed(table, name, analysis["evaluated"], analysis["priors"]).values())
        _interval_row(axis, -row, values, "black" if name == POST else colour_of(name),
                      "o" if masked(name) else "s")
        olds = ([r["models"]["post"]["old_test"] for r in analysis["evaluated"].values()] if name == POST
                else [p["old_test"] for p in table[name]["per_seed"]])
        axis.annotate(f"old {statistics.fmean(olds):.3f}", (1.01, -row), xycoords=("axes fraction", "data"),
                      fontsize=7, va="center")
    axis.axvline(statistics.fmean(per_seed(table, POST, analysis["evaluated"], analysis["priors"]).values()),
                 color="black", linestyle="--", linewidth=1, label="θpost, mean")
    _prior_line(axis, analysis["priors"])
    labels = [name if name == POST else f"{name} ({table[name]['configurations']})" for name in names]
    axis.set_yticks([-row for row in range(len(names))], labels, fontsize=8)
    axis.set(xlim=(0, 0.8), xlabel="new facts, test accuracy (grey: seeds; bar: 95 % interval of the mean)"
             if len(analysis["evaluated"]) > 1 else "new facts, test accuracy (one seed: no interval, no ranking)",
             title=f"chosen on validation, old-task validation ≥ θpost − {tolerance} (configurations)")
    axis.legend(fontsize=7, loc="lower right")


def plot_differences(axis: Axes, analysis: dict[str, Any]) -> None:
    """Every paired difference of the corrected report, both τ, with its 95 % interval; 0 drawn."""
    rows = [row for section in analysis["comparisons"].values() for row in section]
    tolerances = list(analysis["chosen"])
    boundary = 0
    for section in list(analysis["comparisons"].values())[:-1]:
        boundary += len(section)
        axis.axhline(-boundary + 0.5, color="0.7", linewidth=0.8)
    for index, row in enumerate(rows):
        for offset, tolerance in enumerate(tolerances):
            found = row["by_tolerance"][tolerance]
            y = -index + 0.18 * (offset - (len(tolerances) - 1) / 2)
            _interval_row(axis, y, found["diffs"], TOLERANCE_COLOURS[offset])
    for offset, tolerance in enumerate(tolerances):
        axis.plot([], [], "o-", color=TOLERANCE_COLOURS[offset], label=f"τ = {tolerance}: mean, 95 % interval")
    axis.axvline(0, color="black", linewidth=1)
    axis.set_yticks([-i for i in range(len(rows))], [f"{r['left']} − {r['right']}" for r in rows], fontsize=8)
    axis.set(xlabel="paired difference of new-facts test accuracy (grey: seeds)",
             title="paired differences: an interval crossing 0 is inconclusive" if len(analysis["evaluated"]) > 1
             else "paired differences (one seed: no interval, no ranking)")
    axis.legend(fontsize=7, loc="lower right")


def results_figure(analysis: dict[str, Any], path: Path) -> Path:
    """Frontiers, the chosen points at two tolerances and the paired differences, saved at ``path``."""
    chosen_rows = max(len(table) + 1 for table in analysis["chosen"].values())
    differences = sum(len(section) for section in analysis["comparisons"].values())
    heights = (4.5, 0.42 * chosen_rows + 1, 0.36 * differences + 1)
    figure = Figure(figsize=(18, sum(heights)), layout="constrained")
    grid = figure.add_gridspec(3, 2, height_ratios=heights)
    plot_frontiers(figure, grid[0, :], analysis)
    for column, tolerance in enumerate(list(analysis["chosen"])[:2]):
        plot_chosen(figure.add_subplot(grid[1, column]), analysis, tolerance)
    plot_differences(figure.add_subplot(grid[2, :]), analysis)
    figure.savefig(path, dpi=90)
    return path


def plot_results(results: dict[str, Any], root: Path) -> list[Path]:
    """A run's results.png (:func:`results_figure`) and compute.png, in its folder ``root``."""
    return [results_figure(reanalyse(results), root / "results.png"), plot_compute(results, root / "compute.png")]


def plot_frontiers_of_first_seed(results: dict[str, Any], root: Path) -> list[Path]:
    """Registration 2: ``frontier-<method>.png`` of the first seed for the donor question's two methods,
    drawn by the plot ``graftmerge sweep --eval`` writes (validation role scores, θpost, the frontier, the choice)."""
    seed = min(results["seeds"], key=int)
    evaluated = results["seeds"][seed]
    post = evaluated["models"]["post"]
    tolerance = min(float(t) for t in results["chosen"])
    table = member_table(LmDemoSettings(donors=tuple(results["settings"]["donors"]),
                                        opsd=tuple(results["settings"]["opsd"])))
    paths = []
    for name in DONOR_QUESTION:
        points = [p for p in evaluated["points"] if table[name](p)]
        plotted = [PlotPoint(p["lam"], p["rho"], p["old_validation"], p["new_validation"]) for p in points]
        chosen = choose_point(points, post, tolerance)
        index = next((i for i, p in enumerate(points) if p["name"] == chosen["name"]), None)
        frontier = pareto_frontier([p.old for p in plotted], [p.new for p in plotted])
        slug = name.replace(" + ", "-").replace(" ", "-")
        paths.append(plot_sweep_frontier(root / f"frontier-{slug}.png", plotted, (post["old_validation"],
                                   post["new_validation"]), frontier, index, tolerance))
    return paths

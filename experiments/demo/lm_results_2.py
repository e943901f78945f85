"""Registration 2's results page and figure, drawn from a finished run's results.json alone.

Nothing here decides anything: the choices, the gates, every question's tests and the
verdicts are the ones the run computed and recorded (:func:`experiments.demo.lm_verdict.summarize`);
this module lays them out as markdown tables and one figure for ``docs/``. Confidence
intervals on chosen points are one-sample 95 % t intervals over seeds; on differences they
are the recorded paired ones.

The figure has three rows: (1) each method's Pareto frontier over its grid, on the
*validation* scores selection saw (test scores exist only for chosen points), averaged over
the seeds that ran it; (2) the chosen points' new-facts test accuracy at each τ, per seed,
with the mean's interval and chance (1/8); (3) every registered difference with its
interval at each τ and the TOST margin shaded. Labels sit on axes and in legends only.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from experiments.demo.lm_plots import colour_of, masked, pareto_front
from experiments.demo.lm_reanalysis import settings_from_json
from experiments.demo.lm_verdict import member_table
from experiments.paired_tests import paired_t, student_t_quantile
from graftmerge.errors import GraftError

TOLERANCE_COLOURS = ("tab:blue", "tab:green", "tab:olive")
CONFIGURATION = ("family", "replay", "learning_rate", "epochs", "lam", "mask", "rho")
GATE_WORDS = {"sensitivity": "SFT's top-1 % F·Δ² share − the donors'",
              "interference": "plain SFT's best new-facts validation − its best within τ of θpost's task A"}


def check_results(results: Any, where: str) -> dict[str, Any]:
    """``results`` if it is a finished registration-2 results.json; GraftError naming ``where`` otherwise."""
    if not isinstance(results, dict) or results.get("registration") != 2:
        raise GraftError(f"{where}: not a results.json of registration 2 (`graftmerge demo --full` or `--lm`)")
    missing = [k for k in ("chosen", "gates", "questions", "donor_verdicts", "seeds", "settings") if k not in results]
    if missing:
        raise GraftError(f"{where}: results.json has no {', '.join(missing)} (an unfinished or edited run?)")
    return results


def _mean_interval(values: Sequence[float]) -> str:
    """``0.412 [0.371, 0.453]`` (one-sample 95 % t), or the bare value for one seed."""
    if len(values) < 2:
        return f"{values[0]:.3f}"
    test = paired_t(list(values))
    return f"{test.mean:.3f} [{test.low:.3f}, {test.high:.3f}]"


def _difference(row: dict[str, Any]) -> str:
    if row["low"] is None:
        return f"{row['mean']:+.3f}"
    return f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"


def _p(value: float | None) -> str:
    return "–" if value is None else ("< 0.001" if value < 0.001 else f"{value:.3f}")


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """The registered donor verdict per stratum, the primary one first."""
    primary = results["primary_stratum"]
    lines = [f"**Registered donor verdict (replay {primary}): {results['donor_verdict']}.**", ""]
    lines += [f"- replay {stratum}: {words}" for stratum, words in results["donor_verdicts"].items()
              if stratum != primary]
    return lines


def gates_table(results: dict[str, Any]) -> list[str]:
    """Markdown: both gates in every stratum, and each donor's own sensitivity row (reported, not gated)."""
    lines = ["| replay | gate | difference, per seed mean [95 % CI] | needs | one-sided p | seeds | outcome |",
             "|---|---|---|---|---|---|---|"]
    for stratum, rows in results["gates"].items():
        for name in ("sensitivity", "interference"):
            row = rows[name]
            lines.append(f"| {stratum} | {name}: {GATE_WORDS[name]} | {_mean_interval(row['diffs'])} | ≥ "
                         f"{row['least']:g}, p < 0.05 | {_p(row['p'])} | {row['n']} | "
                         f"{'passed' if row['passed'] else '**not passed**'} |")
        for donor, row in rows["sensitivity"].get("per_donor", {}).items():
            lines.append(f"| {stratum} | (reported) SFT − {donor} donor | {_mean_interval(row['diffs'])} | – | "
                         f"{_p(row['p'])} | {row['n']} | – |")
    return lines


def questions_table(results: dict[str, Any]) -> list[str]:
    """Markdown: every registered question, each τ's interval, Holm-adjusted p and TOST p, and the verdict."""
    tolerances = list(results["chosen"])
    margin = next(iter(results["questions"].values()))["margin"] if results["questions"] else 0.05
    head = "| group | difference of new-facts test accuracy |" + "".join(
        f" τ {t}: mean [95 % CI] | p (Holm) | TOST ±{margin:g} p |" for t in tolerances) + " verdict |"
    lines = [head, "|---|---|" + "---|---|---|" * len(tolerances) + "---|"]
    for label, found in results["questions"].items():
        cells = "".join(f" {_difference(row)} | {_p(row['holm_p'])} | {_p(row['tost_p'])} |"
                        for row in found["per_tolerance"])
        lines.append(f"| {found['group']} | {label} (n = {found['per_tolerance'][0]['n']}) |{cells} "
                     f"{found['verdict']} |")
    return lines


def _choice(point: dict[str, Any]) -> str:
    if point["family"] == "post":
        return "θpost"
    mask = "no mask" if not point["rho"] else f"ρ {point['rho']:g}"
    return f"λ {point['lam']:g}, {mask}"


def chosen_table(results: dict[str, Any], tolerance: str) -> list[str]:
    """Markdown: every family's chosen points at τ: test scores with intervals, and how often each choice."""
    lines = ["| method | configs | old test, mean ± sd | new test, mean [95 % CI] | new answer NLL | 8-way "
             "accuracy | choices (λ, ρ: seeds) |", "|---|---|---|---|---|---|---|"]
    for name, row in results["chosen"][tolerance].items():
        per_seed = row["per_seed"]
        choices: dict[str, int] = {}
        for point in per_seed:
            choices[_choice(point)] = choices.get(_choice(point), 0) + 1
        listed = "; ".join(f"{choice}: {count}" for choice, count in sorted(choices.items(), key=lambda c: -c[1]))
        lines.append(f"| {name} | {row['configurations']} | {row['old_test']['mean']:.3f} ± {row['old_test']['sd']:.3f}"
                     f" | {_mean_interval([p['new_test'] for p in per_seed])} | {row['new_test_nll']['mean']:.2f} | "
                     f"{row['new_test_choice']['mean']:.3f} | {listed} |")
    return lines


def setting_table(results: dict[str, Any]) -> list[str]:
    """Markdown: per seed, θpost's and the end donor's task A, the OPSD teacher's go/no-go."""
    threshold = results["settings"].get("teacher_threshold", 0.9)
    lines = ["| seed | θpost task A (validation) | end donor task A (validation) | OPSD teacher, fact in context |",
             "|---|---|---|---|"]
    for row in results["setting"]:
        teacher = row["teacher_new_train"]
        go = "go" if teacher >= threshold else "**no-go: OPSD arm stopped**"
        lines.append(f"| {row['seed']} | {row['post_task_a']:.3f} | {row['end_donor_task_a']:.3f} | "
                     f"{teacher:.3f} ({go}) |")
    return lines


def shares_table(results: dict[str, Any]) -> list[str]:
    """Markdown: each update family's mean top-1 % F·Δ² share (the paper's Fig. 8, right)."""
    lines = ["| update family (snapshot names) | share of F·Δ² on θpost's top-1 % Fisher coordinates |", "|---|---|"]
    lines += [f"| {family} | {share:.3f} |" for family, share in results["top_share"].items()]
    return lines


def edges_line(results: dict[str, Any]) -> str:
    """How many chosen masked points sit on an edge of the λ or ρ grid."""
    edges, settings = results["edges"], results["settings"]
    rhos = [rho for _, rho in settings["masks"] if rho]
    return (f"Of {edges['masked_points']} chosen masked points (every family, seed and τ): λ at the grid's smallest "
            f"({min(settings['lambdas']):g}) {edges['lambda_smallest']}, at its largest ({max(settings['lambdas']):g}) "
            f"{edges['lambda_largest']}; ρ at the smallest ({min(rhos):g}) {edges['rho_smallest']}, at the largest "
            f"({max(rhos):g}) {edges['rho_largest']}.")


def markdown_report(results: dict[str, Any]) -> str:
    """Every table of the results page (what `experiments/reanalyse_demo.py` prints for a registration-2 run)."""
    seeds = len(results["seeds"])
    spread = (f"95 % t intervals over n seeds (n − 1 degrees of freedom; ± {student_t_quantile(0.975, seeds - 1):.2f}"
              " standard errors at n = {seeds})".replace("{seeds}", str(seeds)) if seeds > 1 else "none (one seed)")
    lines = [f"Seeds: {', '.join(map(str, sorted(results['seeds'], key=int)))}. Intervals: {spread}; the verdicts, "
             "gates and choices are the ones the run recorded. Tables generated from the run's results.json by "
             "`experiments/reanalyse_demo.py`.", ""]
    lines += verdict_lines(results)
    lines += ["", "### Gates", ""] + gates_table(results)
    lines += ["", "### Every registered question", ""] + questions_table(results)
    for tolerance in results["chosen"]:
        lines += ["", f"### Chosen on validation (old-task validation ≥ θpost − {tolerance}), test scores", ""]
        lines += chosen_table(results, tolerance)
    lines += ["", edges_line(results)]
    lines += ["", "### The setting, per seed", ""] + setting_table(results)
    lines += ["", "### Top-1 % F·Δ² share per update family (mean over snapshots and seeds)", ""]
    lines += shares_table(results)
    return "\n".join(lines) + "\n"


def configuration_means(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every configuration's validation scores, averaged over the seeds that ran it (a stopped arm is absent)."""
    grouped: dict[tuple, list[dict]] = {}
    for seed in results["seeds"].values():
        for point in seed["points"]:
            grouped.setdefault(tuple(point.get(k) for k in CONFIGURATION), []).append(point)
    return [{**dict(zip(CONFIGURATION, key)),
             **{s: statistics.fmean(p[s] for p in points) for s in ("old_validation", "new_validation")}}
            for key, points in grouped.items()]


def frontier_panels(opsd: Sequence[str]) -> dict[str, list[str]]:
    """Panel title → families drawn there: each update method unmasked (dashed) and masked (solid)."""
    panels = {"SFT of θpost": ["SFT + merge", "SFT + merge + mask"]}
    for kind in opsd:
        panels[f"OPSD-{kind} of θpost"] = [f"OPSD-{kind} + merge", f"OPSD-{kind} + merge + mask"]
    panels["graft (donor chosen on validation)"] = ["graft, no mask", "graft"]
    panels["masked methods together"] = ["SFT + merge + mask", *(f"OPSD-{k} + merge + mask" for k in opsd), "graft"]
    return panels


def plot_frontiers(figure: Figure, place: Any, results: dict[str, Any]) -> None:
    """Validation Pareto frontiers per panel, θpost (star), chance, and θpost − τ."""
    settings = settings_from_json(results["settings"])
    members = member_table(settings)
    means = configuration_means(results)
    seeds = list(results["seeds"].values())
    post = {s: statistics.fmean(r["models"]["post"][s] for r in seeds) for s in ("old_validation", "new_validation")}
    panels = frontier_panels(settings.opsd)
    axes = place.subgridspec(1, len(panels)).subplots(sharex=True, sharey=True)
    for axis, (title, names) in zip(axes, panels.items()):
        for name in names:
            inside = [p for p in means if members[name](p)]
            axis.scatter([p["new_validation"] for p in inside], [p["old_validation"] for p in inside], s=4,
                         color="0.82", zorder=1)
            front = pareto_front([(p["new_validation"], p["old_validation"]) for p in inside])
            axis.plot([x for x, _ in front], [y for _, y in front], drawstyle="steps-pre", marker="o", markersize=3,
                      color=colour_of(name), linestyle="-" if masked(name) else "--", label=name, zorder=3)
        axis.plot(post["new_validation"], post["old_validation"], "*", color="black", markersize=12, zorder=4,
                  label="θpost")
        axis.axvline(results["chance"], color="tab:green", linewidth=1.2, label="chance (1/8)")
        for tolerance, style in zip(results["chosen"], (":", "-.")):
            axis.axhline(post["old_validation"] - float(tolerance), color="0.4", linestyle=style, linewidth=1,
                         label=f"θpost − {tolerance}")
        axis.set(title=title, xlabel="new facts, validation accuracy", xlim=(0, 1.02),
                 ylim=(max(0.0, post["old_validation"] - 0.3), 1.01))
        axis.legend(fontsize=6.5, loc="lower left")
    axes[0].set(ylabel="task A, validation accuracy")
    figure.suptitle(f"Validation Pareto frontiers over each method's grid (what selection saw), every configuration "
                    f"averaged over the seeds that ran it ({len(seeds)} seeds). Dashed: unmasked; solid: masks "
                    "allowed; grey: configurations", fontsize=9, x=0.01, ha="left")


def _interval_row(axis: Axes, y: float, values: list[float], colour: str, marker: str = "o") -> None:
    axis.scatter(values, [y] * len(values), s=10, color="0.5", zorder=2)
    if len(values) > 1:
        test = paired_t(values)
        axis.plot([test.low, test.high], [y, y], color=colour, linewidth=2.2, zorder=3)
    axis.plot(statistics.fmean(values), y, marker, color=colour, markersize=7, zorder=4)


def plot_chosen(axis: Axes, results: dict[str, Any], tolerance: str) -> None:
    """Chosen points' new-facts test accuracy at τ: seeds (grey), mean and its interval, chance."""
    table = results["chosen"][tolerance]
    names = list(table)
    for row, name in enumerate(names):
        _interval_row(axis, -row, [p["new_test"] for p in table[name]["per_seed"]], colour_of(name),
                      "o" if masked(name) else "s")
    axis.axvline(results["chance"], color="tab:green", linewidth=1.2, label="chance (1/8)")
    axis.set_yticks([-row for row in range(len(names))], [f"{n} ({table[n]['configurations']})" for n in names],
                    fontsize=7.5)
    axis.set(xlim=(0, 1.02), xlabel="new facts, test accuracy (grey: seeds; bar: 95 % interval of the mean)",
             title=f"chosen on validation at τ = {tolerance} (configurations)")
    axis.legend(fontsize=7, loc="lower right")


def plot_questions(axis: Axes, results: dict[str, Any]) -> None:
    """Every registered difference at every τ with its interval; 0 and the TOST margin drawn."""
    labels = list(results["questions"])
    margin = results["questions"][labels[0]]["margin"] if labels else 0.05
    axis.axvspan(-margin, margin, color="0.9", zorder=0, label=f"TOST margin ±{margin:g}")
    for index, label in enumerate(labels):
        rows = results["questions"][label]["per_tolerance"]
        for offset, row in enumerate(rows):
            y = -index + 0.2 * (offset - (len(rows) - 1) / 2)
            _interval_row(axis, y, row["diffs"], TOLERANCE_COLOURS[offset % len(TOLERANCE_COLOURS)])
    for offset, tolerance in enumerate(results["chosen"]):
        axis.plot([], [], "o-", color=TOLERANCE_COLOURS[offset], label=f"τ = {tolerance}: mean, 95 % interval")
    axis.axvline(0, color="black", linewidth=1)
    axis.set_yticks([-i for i in range(len(labels))],
                    [f"{label}  → {results['questions'][label]['verdict']}" for label in labels], fontsize=7.5)
    axis.set(xlabel="paired difference of new-facts test accuracy (grey: seeds)",
             title="registered questions (verdict after the arrow; gates decide the donor verdict)")
    axis.legend(fontsize=7, loc="lower right")


def results_figure(results: dict[str, Any], path: Path) -> Path:
    """The three rows described in the module docstring, saved at ``path``."""
    rows = max(len(table) for table in results["chosen"].values())
    heights = (4.6, 0.3 * rows + 1.2, 0.34 * len(results["questions"]) + 1.2)
    figure = Figure(figsize=(18, sum(heights)), layout="constrained")
    grid = figure.add_gridspec(3, 2, height_ratios=heights)
    plot_frontiers(figure, grid[0, :], results)
    for column, tolerance in enumerate(list(results["chosen"])[:2]):
        plot_chosen(figure.add_subplot(grid[1, column]), results, tolerance)
    plot_questions(figure.add_subplot(grid[2, :]), results)
    figure.savefig(path, dpi=80)
    return path

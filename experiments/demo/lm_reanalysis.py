"""A second look at a finished `demo --lm` run: intervals, a value-prior baseline, the paper's baselines, grid edges.

Reads what a run recorded (results.json: its settings and every evaluated grid point) and
recomputes, without training anything:

- every method's chosen point with :func:`lm_report.chosen_points` (checked against the
  choices the run recorded), plus the unmasked "OPSD + merge" the run did not tabulate;
- a 95 % paired-t interval on every paired difference (per-seed differences; n seeds give
  n − 1 degrees of freedom), "inconclusive" where it spans 0, Holm-adjusted p within each
  group of comparisons, and for the donor question the smallest TOST margin the data
  would call equivalent;
- the **value prior**: a model that answers every question about a relation with that
  relation's most common value among the new facts' training answers, linking no entity to
  anything. Computed from the seed's own world and splits, scored by exact match of every
  answer token as the demo scores (:func:`lm.score`);
- where the chosen λ and ρ sit in the grid (an optimum on an edge may lie outside it).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from experiments.demo.lm import ModelSize
from experiments.demo.lm_report import chosen_points
from experiments.demo.lm_settings import FOLDER_AT, LmDemoSettings
from experiments.demo.lm_training import seed_world
from experiments.demo.world import ANSWER, Example, SplitSizes, World
from experiments.paired_tests import (
    PairedTest,
    equivalence_bound,
    holm,
    paired_t,
    student_t_quantile,
)
from graftmerge.errors import GraftError

PRIOR = "value prior"
POST = "θpost"
ANSWER_RELATION = ANSWER.split().index("{r}")  # where the relation word sits in an answer
SECTIONS = {
    "donor": "The donor question: the graft against the same update methods with the same masks",
    "baselines": "Against the paper's own baselines (no mask on the baselines)",
    "mask": "The mask: masked against unmasked, same update method",
    "earlier": "Earlier donors against the final one",
}


def settings_from_json(raw: dict[str, Any]) -> LmDemoSettings:
    """The run's LmDemoSettings from results.json's ``settings`` (lists back to tuples)."""
    values = {}
    for field in dataclasses.fields(LmDemoSettings):
        if field.name not in raw:
            continue
        value = raw[field.name]
        if field.name == "size":
            value = ModelSize(**value)
        elif field.name == "splits":
            value = SplitSizes(**value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        values[field.name] = value
    return LmDemoSettings(**values)


def evaluated_from_json(results: dict[str, Any], where: str) -> tuple[LmDemoSettings, dict[int, dict]]:
    """The run's settings and per-seed evaluations (seed keys back to ints); GraftError if it is not a run."""
    missing = [key for key in ("settings", "seeds", "chosen") if key not in results]
    if missing:
        raise GraftError(f"{where}: not a results.json of `graftmerge demo --lm` (no {', '.join(missing)})")
    try:
        settings = settings_from_json(results["settings"])
        evaluated = {int(seed): value for seed, value in results["seeds"].items()}
    except (TypeError, ValueError) as error:
        raise GraftError(f"{where}: corrupt demo results ({error})") from error
    return settings, evaluated


def relation_of(world: World, example: Example) -> str:
    """The relation a new-fact example asks about (read from its answer, ``the {r} is {v} .``)."""
    return world.words[example.ids[example.answer_start + ANSWER_RELATION]]


def prior_answers(world: World, train: Sequence[Example]) -> dict[str, tuple[int, ...]]:
    """Relation → its most common complete answer among the training examples (ties: either scores the same)."""
    counts: dict[str, Counter] = {}
    for example in train:
        counts.setdefault(relation_of(world, example), Counter())[tuple(example.ids[example.answer_start:])] += 1
    return {relation: count.most_common(1)[0][0] for relation, count in counts.items()}


def prior_accuracy(world: World, answers: dict[str, tuple[int, ...]], examples: Sequence[Example]) -> float:
    """Exact match of every answer token (the demo's score) for a model that answers ``answers[relation]``."""
    hits = sum(tuple(e.ids[e.answer_start:]) == answers[relation_of(world, e)] for e in examples)
    return hits / len(examples)


def value_prior(settings: LmDemoSettings, seed: int) -> dict[str, float]:
    """The value prior's new-task validation and test accuracy in the seed's own world and splits."""
    world, splits = seed_world(settings, seed)
    answers = prior_answers(world, splits.new_train)
    return {"new_validation": prior_accuracy(world, answers, splits.new_validation),
            "new_test": prior_accuracy(world, answers, splits.new_test)}


def check_recorded_choices(recomputed: dict[str, dict], recorded: dict[str, dict], where: str) -> None:
    """GraftError if a choice recomputed from the grid differs from the one the run recorded."""
    for tolerance, rows in recorded.items():
        for name, row in rows.items():
            again = recomputed.get(tolerance, {}).get(name)
            if again is None or again["per_seed"] != row["per_seed"]:
                raise GraftError(f"{where}: the chosen point of {name!r} at τ {tolerance} does not follow "
                                 "from the recorded grid (results edited, or made by other selection code)")


def per_seed(rows: dict[str, dict], name: str, evaluated: dict[int, dict], priors: dict[int, dict]) -> dict[int, float]:
    """Seed → new-task test accuracy of ``name``: a chosen row, θpost or the value prior."""
    if name == PRIOR:
        return {seed: prior["new_test"] for seed, prior in priors.items()}
    if name == POST:
        return {seed: result["models"]["post"]["new_test"] for seed, result in evaluated.items()}
    return {point["seed"]: point["new_test"] for point in rows[name]["per_seed"]}


def compare(left: dict[int, float], right: dict[int, float]) -> dict[str, Any]:
    """Paired per-seed differences left − right: the differences, win/tie/loss counts and the t analysis."""
    diffs = [left[seed] - right[seed] for seed in sorted(left) if seed in right]
    test = paired_t(diffs) if len(diffs) > 1 else None
    return {"diffs": diffs, "wins": sum(d > 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
            "losses": sum(d < 0 for d in diffs), "test": test}


def section_pairs(settings: LmDemoSettings) -> dict[str, list[tuple[str, str]]]:
    """The comparisons of each section, as (left, right) row names."""
    opsd = [f"OPSD-{kind}" for kind in settings.opsd]
    return {
        "donor": [("graft", "SFT + merge + mask")] + [("graft", f"{o} + merge + mask") for o in opsd],
        "baselines": [("graft", "SFT"), ("graft", "SFT + merge")]
        + [("graft", name) for o in opsd for name in (o, f"{o} + merge")],
        "mask": [("graft", "graft, no mask"), ("SFT + merge + mask", "SFT + merge")]
        + [(f"{o} + merge + mask", f"{o} + merge") for o in opsd]
        + [(f"graft@{d}", f"graft@{d}, no mask") for d in settings.donors],
        "earlier": [(f"graft@{d}", "graft@end") for d in settings.donors if d != "end"],
    }


def comparisons(settings: LmDemoSettings, chosen: dict[str, dict], evaluated: dict[int, dict],
                priors: dict[int, dict]) -> dict[str, list[dict[str, Any]]]:
    """Section → its comparisons at every τ, with Holm-adjusted p over the section's tests."""
    result = {}
    for section, pairs in section_pairs(settings).items():
        rows = []
        for left, right in pairs:
            if all(name in chosen[t] for t in chosen for name in (left, right)):
                row: dict[str, Any] = {"left": left, "right": right, "by_tolerance": {}}
                for tolerance, table in chosen.items():
                    found = compare(per_seed(table, left, evaluated, priors), per_seed(table, right, evaluated, priors))
                    if section == "donor" and found["test"] is not None:
                        found["equivalence_bound"] = equivalence_bound(found["diffs"])
                    row["by_tolerance"][tolerance] = found
                rows.append(row)
        tests = [c for row in rows for c in row["by_tolerance"].values() if c["test"] is not None]
        for entry, adjusted in zip(tests, holm([c["test"].p for c in tests])):
            entry["holm_p"] = adjusted
        result[section] = rows
    return result


def baseline_wins(settings: LmDemoSettings, chosen: dict[str, dict], evaluated: dict[int, dict],
                  priors: dict[int, dict]) -> dict[str, dict[str, dict[str, int]]]:
    """Masked method → τ → against how many of the paper's baselines it wins every seed, and with an interval > 0."""
    baselines = [right for left, right in section_pairs(settings)["baselines"]]
    masked = ["SFT + merge + mask", *(f"OPSD-{k} + merge + mask" for k in settings.opsd), "graft"]
    result: dict[str, dict[str, dict[str, int]]] = {}
    for method in masked:
        for tolerance, table in chosen.items():
            if method not in table or not all(b in table for b in baselines):
                continue
            found = [compare(per_seed(table, method, evaluated, priors), per_seed(table, b, evaluated, priors))
                     for b in baselines]
            result.setdefault(method, {})[tolerance] = {
                "every_seed": sum(f["wins"] == len(f["diffs"]) for f in found),
                "interval_above_0": sum(f["test"] is not None and f["test"].low > 0 for f in found),
                "baselines": len(baselines)}
    return result


def top_shares(evaluated: dict[int, dict]) -> dict[str, dict[int, float]]:
    """Update family → seed → share of F·Δ² on θpost's top-1 % Fisher coordinates, mean over its snapshots."""
    shares: dict[str, dict[int, list[float]]] = {}
    for seed, result in evaluated.items():
        for name, stats in result["updates"].items():
            if not name.startswith("post-") and stats.get("top_share") is not None:
                family = name.split("-lr")[0].replace(FOLDER_AT, "@")
                shares.setdefault(family, {}).setdefault(seed, []).append(stats["top_share"])
    return {family: {seed: statistics.fmean(v) for seed, v in sorted(by_seed.items())}
            for family, by_seed in sorted(shares.items())}


def share_comparisons(evaluated: dict[int, dict]) -> list[dict[str, Any]]:
    """Each update family's top-1 % share against SFT's, paired per seed (the paper's precondition: donors lower)."""
    shares = top_shares(evaluated)
    if "sft" not in shares:
        return []
    return [{"family": family, "mean": statistics.fmean(by_seed.values()), **compare(by_seed, shares["sft"])}
            for family, by_seed in shares.items() if family != "sft"]


def grid_edges(settings: LmDemoSettings, chosen: dict[str, dict]) -> list[dict[str, Any]]:
    """Per τ and masked method row: each seed's chosen λ and ρ, and whether they sit on the grid's edge."""
    smallest, largest = min(settings.lambdas), max(settings.lambdas)
    top_rho = max(rho for _, rho in settings.masks)
    rows = []
    for tolerance, table in chosen.items():
        for name, row in table.items():
            points = [p for p in row["per_seed"] if p["family"] != "post" and p["rho"] > 0]
            if "no mask" in name or not points:
                continue
            rows.append({"tolerance": tolerance, "method": name, "lambdas": [p["lam"] for p in points],
                         "masks": [f"{p['mask']} {p['rho']:g}" for p in points],
                         "lam_smallest": sum(p["lam"] == smallest for p in points),
                         "lam_largest": sum(p["lam"] == largest for p in points),
                         "rho_largest": sum(p["rho"] == top_rho for p in points), "n": len(points)})
    return rows


def reanalyse(results: dict[str, Any], where: str = "results.json") -> dict[str, Any]:
    """Everything the corrected report states, recomputed from a run's results.json."""
    settings, evaluated = evaluated_from_json(results, where)
    chosen = chosen_points(settings, evaluated)
    check_recorded_choices(chosen, results["chosen"], where)
    priors = {seed: value_prior(settings, seed) for seed in sorted(evaluated)}
    above_prior = {tolerance: {name: compare(per_seed(table, name, evaluated, priors),
                                             per_seed(table, PRIOR, evaluated, priors))
                               for name in [POST, *table]}
                   for tolerance, table in chosen.items()}
    return {"settings": settings, "evaluated": evaluated, "chosen": chosen, "priors": priors,
            "above_prior": above_prior, "comparisons": comparisons(settings, chosen, evaluated, priors),
            "edges": grid_edges(settings, chosen), "shares": share_comparisons(evaluated),
            "baseline_wins": baseline_wins(settings, chosen, evaluated, priors),
            "sft_share": statistics.fmean(top_shares(evaluated).get("sft", {0: math.nan}).values())}


def interval(test: PairedTest | None, mean: float) -> str:
    """``+0.108 [+0.068, +0.148]``, or the bare mean where one seed gives no interval."""
    if test is None:
        return f"{mean:+.3f} (1 seed, no interval)"
    return f"{test.mean:+.3f} [{test.low:+.3f}, {test.high:+.3f}]"


def _verdict(test: PairedTest | None) -> str:
    return "n/a (1 seed)" if test is None else test.verdict


def _counts(found: dict[str, Any]) -> str:
    return f"{found['wins']}/{found['ties']}/{found['losses']}"


def prior_table(analysis: dict[str, Any]) -> list[str]:
    """Markdown: the value prior and θpost, per seed."""
    priors, evaluated = analysis["priors"], analysis["evaluated"]
    lines = ["| seed | value prior, new validation | value prior, new test | θpost, new test |", "|---|---|---|---|"]
    for seed, prior in priors.items():
        lines.append(f"| {seed} | {prior['new_validation']:.3f} | {prior['new_test']:.3f} | "
                     f"{evaluated[seed]['models']['post']['new_test']:.3f} |")
    if len(priors) > 1:
        mean = {key: sum(p[key] for p in priors.values()) / len(priors) for key in ("new_validation", "new_test")}
        post = sum(r["models"]["post"]["new_test"] for r in evaluated.values()) / len(evaluated)
        lines.append(f"| mean | {mean['new_validation']:.3f} | {mean['new_test']:.3f} | {post:.3f} |")
    return lines


def chosen_table(analysis: dict[str, Any], tolerance: str) -> list[str]:
    """Markdown: every method's chosen point at τ, its test scores and its distance to the value prior."""
    table, above = analysis["chosen"][tolerance], analysis["above_prior"][tolerance]
    lines = ["| method | configs | old test, mean ± sd | new test, mean [95 % CI] | new − value prior, mean "
             "[95 % CI] | seeds above / at / below the prior |", "|---|---|---|---|---|---|"]
    for name in [POST, *table]:
        scores = per_seed(table, name, analysis["evaluated"], analysis["priors"])
        values = list(scores.values())
        level = paired_t(values) if len(values) > 1 else None
        if name == POST:
            olds = [r["models"]["post"]["old_test"] for r in analysis["evaluated"].values()]
            configs = "–"
        else:
            olds, configs = [p["old_test"] for p in table[name]["per_seed"]], str(table[name]["configurations"])
        old = paired_t(olds) if len(olds) > 1 else None
        old_text = f"{olds[0]:.3f}" if old is None else f"{old.mean:.3f} ± {old.sd:.3f}"
        new_text = f"{values[0]:.3f}" if level is None else f"{level.mean:.3f} [{level.low:.3f}, {level.high:.3f}]"
        found = above[name]
        lines.append(f"| {name} | {configs} | {old_text} | {new_text} | "
                     f"{interval(found['test'], found['diffs'][0])} | {_counts(found)} |")
    return lines


def comparison_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: one section's paired differences, every τ side by side."""
    tolerances = list(rows[0]["by_tolerance"]) if rows else []
    head = "| difference (new test) |" + "".join(f" τ {t}: mean [95 % CI] | + / = / − | p (Holm) | verdict |"
                                                 for t in tolerances)
    lines = [head, "|---|" + "---|---|---|---|" * len(tolerances)]
    for row in rows:
        cells = ""
        for found in row["by_tolerance"].values():
            test = found["test"]
            p_text = "–" if test is None else f"{test.p:.3f} ({found['holm_p']:.2f})"
            cells += f" {interval(test, found['diffs'][0])} | {_counts(found)} | {p_text} | {_verdict(test)} |"
        lines.append(f"| {row['left']} − {row['right']} |{cells}")
    return lines


def edges_table(analysis: dict[str, Any]) -> list[str]:
    """Markdown: the chosen masked points' λ and ρ, and how many sit on the grid's edges."""
    settings = analysis["settings"]
    lines = [f"λ grid {', '.join(f'{v:g}' for v in settings.lambdas)}; masks "
             + ", ".join("none" if m is None else f"{m} ρ {r:g}" for m, r in settings.masks) + ".", "",
             "| τ | method | λ per seed | mask, ρ per seed | λ = smallest | ρ = largest |", "|---|---|---|---|---|---|"]
    for row in analysis["edges"]:
        lines.append(
            f"| {row['tolerance']} | {row['method']} | {', '.join(f'{v:g}' for v in row['lambdas'])} | "
            f"{', '.join(row['masks'])} | {row['lam_smallest']}/{row['n']} | {row['rho_largest']}/{row['n']} |"
        )
    total = sum(r["n"] for r in analysis["edges"])
    lines += ["", f"Over these {total} chosen masked points: λ at the grid's smallest value in "
              f"{sum(r['lam_smallest'] for r in analysis['edges'])}, at its largest in "
              f"{sum(r['lam_largest'] for r in analysis['edges'])}; ρ at the grid's largest in "
              f"{sum(r['rho_largest'] for r in analysis['edges'])}."]
    return lines


def baseline_wins_table(analysis: dict[str, Any]) -> list[str]:
    """Markdown: each masked method against the paper's baselines, counted."""
    tolerances = list(analysis["chosen"])
    lines = ["| masked method |" + "".join(f" τ {t}: beats in every seed | interval above 0 |" for t in tolerances),
             "|---|" + "---|---|" * len(tolerances)]
    for method, by_tolerance in analysis["baseline_wins"].items():
        cells = "".join(f" {c['every_seed']} of {c['baselines']} | {c['interval_above_0']} of {c['baselines']} |"
                        for c in by_tolerance.values())
        lines.append(f"| {method} |{cells}")
    return lines


def shares_table(analysis: dict[str, Any]) -> list[str]:
    """Markdown: each update family's share of F·Δ² on θpost's top-1 % Fisher coordinates against SFT's."""
    lines = [f"SFT's share: {analysis['sft_share']:.3f} (mean over seeds of the mean over its snapshots).", "",
             "| update | share | − SFT's share, mean [95 % CI] | + / = / − | verdict |", "|---|---|---|---|---|"]
    for row in analysis["shares"]:
        lines.append(f"| {row['family']} | {row['mean']:.3f} | {interval(row['test'], row['diffs'][0])} | "
                     f"{_counts(row)} | {_verdict(row['test'])} |")
    return lines


def markdown_report(analysis: dict[str, Any]) -> str:
    """The corrected tables, as markdown (what `experiments/reanalyse_demo.py` prints)."""
    seeds = len(analysis["priors"])
    spread = (f"paired t on per-seed differences, 95 %, n = {seeds} seeds, {seeds - 1} degree(s) of freedom "
              f"(± {student_t_quantile(0.975, seeds - 1):.2f} standard errors)" if seeds > 1 else
              "none (one seed: no method can be ranked)")
    lines = [
        f'Seeds: {", ".join(map(str, analysis["priors"]))}. Intervals: {spread}; '
        '"inconclusive" = the interval contains 0. Intervals are not adjusted for '
        "multiplicity; the p in brackets is Holm-adjusted within its table. + / = / −: seeds where the "
        "difference is above, at or below 0. Every number below is recomputed from the run's JSON by "
        "`experiments/reanalyse_demo.py`.",
        "",
        "### The value prior",
        "",
    ]
    lines += prior_table(analysis)
    for tolerance in analysis["chosen"]:
        lines += ["", f"### Chosen on validation (old-task validation ≥ θpost − {tolerance}), test scores", ""]
        lines += chosen_table(analysis, tolerance)
    for section, rows in analysis["comparisons"].items():
        lines += ["", f"### {SECTIONS[section]}", ""] + comparison_table(rows)
        if section == "baselines" and analysis["baseline_wins"]:
            lines += ["", "Every masked method against the same baselines, counted:", ""]
            lines += baseline_wins_table(analysis)
        if section == "donor" and seeds > 1:
            lines += ["", "Smallest equivalence margin TOST (α 0.05) would accept: " + "; ".join(
                f"{row['left']} − {row['right']} at τ {t}: ±{found['equivalence_bound']:.3f}"
                for row in rows for t, found in row["by_tolerance"].items() if "equivalence_bound" in found) + "."]
    if analysis["shares"]:
        lines += ["", "### The paper's precondition: do donors write less to θpost's sensitive coordinates?", ""]
        lines += shares_table(analysis)
    lines += ["", "### Where the chosen λ and ρ sit in the grid", ""] + edges_table(analysis)
    return "\n".join(lines) + "\n"

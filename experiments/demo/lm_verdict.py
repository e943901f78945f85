"""Pre-registration 2's analysis (docs/demo-preregistration-2.md), computed from the run's points alone.

Selection is the rule ``graftmerge sweep --eval`` uses (:func:`graftmerge.math.frontier.choose`
on the normalised role scores of :mod:`graftmerge.evaluation`): per method family and τ, the
highest new-role *validation* score among points whose old-role validation score is at least
θpost's − τ; ties to the smaller λ, then the smaller ρ, then the earlier point in canonical
order; θpost when none qualifies. Test scores exist only for the points some family chose
(the seed's test job merges them again), so selection cannot see test.

Each registered question is a paired difference of chosen points' new-task test accuracy
(one difference per seed) tested at every τ: a two-sided paired t, its p-values Holm-adjusted
across τ, and TOST with the margin registered here. Its verdict (:func:`verdict`) is
"positive"/"negative" where a Holm-adjusted test rejects, "equivalent" where every τ's TOST
accepts (an intersection–union test: no correction needed), else "inconclusive". With several
replays, the donor question is asked within each replay (the headline one: ``PRIMARY_REPLAY``)
and answered only if both gates pass there: donors write measurably less F·Δ² to θpost's
top-1 % Fisher coordinates than SFT (:func:`gate`), and plain SFT interferes: its best
new-task validation score is measurably above the best it reaches within τ of θpost's task A
(:func:`interference`); else "this setting cannot test it".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from experiments.demo.lm_report import compute_table, families, sensitivity, spread
from experiments.demo.lm_settings import FOLDER_AT, LmDemoSettings
from experiments.paired_tests import holm, paired_t, tost
from graftmerge.math.frontier import choose

Point = dict[str, Any]
ALPHA = 0.05
MARGIN = 0.05  # TOST: |difference| < 0.05 of new-task accuracy counts as "the same" (the power analysis's δ)
GATE_REDUCTION = 0.02  # donors' top-1 % share must be at least this much below SFT's, and significantly so
INTERFERENCE = 0.05  # plain SFT's best new-task validation must exceed its best within τ by this much, significantly
PRIMARY_REPLAY = "none"  # the stratum whose donor verdict is the headline (docs/demo-preregistration-2.md says why)
CHANCE = 1 / 8  # a model that ignores the entity, with values dealt evenly (world.balanced_values)
DONOR_QUESTION = ("graft", "SFT + merge + mask")
TESTED = ("old_test", "new_test", "new_test_nll", "new_test_choice", "new_validation_nll", "new_validation_choice")


def choose_point(points: Sequence[Point], post: dict[str, float], tolerance: float) -> Point:
    """The point the sweep's rule chooses from validation role scores; θpost (as a point) when none qualifies."""
    index = choose([p["old_validation"] for p in points], [p["new_validation"] for p in points],
                   [p["lam"] for p in points], [p["rho"] for p in points], post["old_validation"], tolerance)
    if index is None:
        return {**post, "name": "post", "family": "post", "lam": 0.0, "rho": 0.0, "mask": None,
                "learning_rate": None, "epochs": None, "replay": None}
    return points[index]


def member_table(settings: LmDemoSettings) -> dict[str, Any]:
    """Method family → membership test: the registration-1 families, plus the graft and masked SFT per replay."""
    table = families(settings)
    if len(settings.replays) > 1:
        for name in (*DONOR_QUESTION, "SFT"):
            for replay in settings.replays:
                table[f"{name} [replay {replay}]"] = (
                    lambda p, member=table[name], replay=replay: member(p) and p.get("replay") == replay)
    return table


def chosen_names(settings: LmDemoSettings, points: Sequence[Point], post: dict[str, float]) -> list[str]:
    """The names of every point some family chooses at some τ (the points the test job scores), sorted."""
    names = set()
    for member in member_table(settings).values():
        inside = [p for p in points if member(p)]
        for tolerance in settings.tolerances:
            if inside:
                names.add(choose_point(inside, post, tolerance)["name"])
    names.discard("post")
    return sorted(names)


def chosen_points(settings: LmDemoSettings, evaluated: dict[int, dict]) -> dict[str, dict[str, Any]]:
    """τ → family → per-seed chosen points (with their test scores), test means ± sd, configuration count."""
    result: dict[str, dict[str, Any]] = {}
    for tolerance in settings.tolerances:
        rows = {}
        for name, member in member_table(settings).items():
            per_seed, counts = [], []
            for seed in sorted(evaluated):
                post = evaluated[seed]["models"]["post"]
                points = [p for p in evaluated[seed]["points"] if member(p)]
                if points:
                    point = choose_point(points, post, tolerance)
                    tested = post if point["name"] == "post" else evaluated[seed]["tested"][point["name"]]
                    per_seed.append({**point, **{k: tested[k] for k in TESTED}, "seed": seed})
                    counts.append(len(points))
            if per_seed:
                rows[name] = {"configurations": counts[0], "per_seed": per_seed,
                              **{k: spread([p[k] for p in per_seed]) for k in TESTED}}
        result[f"{tolerance:g}"] = rows
    return result


def differences(rows: dict[str, Any], left: str, right: str, metric: str = "new_test") -> list[float]:
    """Per-seed ``left`` − ``right`` of the chosen points' ``metric`` (right may be a number: a constant)."""
    if isinstance(right, float):
        return [p[metric] - right for p in rows[left]["per_seed"]]
    other = {p["seed"]: p[metric] for p in rows[right]["per_seed"]}
    return [p[metric] - other[p["seed"]] for p in rows[left]["per_seed"] if p["seed"] in other]


def verdict(outcomes: Sequence[dict[str, Any]]) -> str:
    """One question's verdict from its per-τ outcomes (each: mean, holm_p, tost_p); see the module doc."""
    if any(o["holm_p"] is None for o in outcomes):
        return "too few seeds"
    positive = any(o["holm_p"] < ALPHA and o["mean"] > 0 for o in outcomes)
    negative = any(o["holm_p"] < ALPHA and o["mean"] < 0 for o in outcomes)
    if positive != negative:
        return "positive" if positive else "negative"
    if not positive and all(o["tost_p"] < ALPHA for o in outcomes):
        return "equivalent"
    return "inconclusive"


def question(diffs: dict[str, list[float]], margin: float = MARGIN) -> dict[str, Any]:
    """Paired t per τ (Holm across τ), TOST per τ, and the verdict, from per-seed differences per τ."""
    outcomes = []
    for tolerance, values in diffs.items():
        row: dict[str, Any] = {"tolerance": tolerance, "n": len(values), "diffs": values,
                               "mean": statistics.fmean(values) if values else math.nan,
                               "p": None, "holm_p": None, "tost_p": None, "low": None, "high": None}
        if len(values) >= 2:
            test = paired_t(values)
            row.update(p=test.p, low=test.low, high=test.high, sd=test.sd, tost_p=tost(values, margin).p)
        outcomes.append(row)
    if all(o["p"] is not None for o in outcomes):
        for outcome, adjusted in zip(outcomes, holm([o["p"] for o in outcomes])):
            outcome["holm_p"] = adjusted
    return {"per_tolerance": outcomes, "verdict": verdict(outcomes), "margin": margin}


def _family_shares(evaluated: dict[int, dict], prefix: str, replay: str | None = None) -> dict[int, float]:
    """Per seed: the mean top-1 % F·Δ² share over every update snapshot whose family starts with ``prefix``
    (and, given ``replay``, trained with that replay)."""
    shares = {}
    for seed, result in evaluated.items():
        values = [s["top_share"] for name, s in result["updates"].items()
                  if not name.startswith("post-") and name.replace(FOLDER_AT, "@").split("-")[0].startswith(prefix)
                  and (replay is None or f"-rp{replay}-" in name) and s["top_share"] is not None]
        if values:
            shares[seed] = statistics.fmean(values)
    return shares


def gate(shares: dict[str, dict[int, float]], reduction: float = GATE_REDUCTION) -> dict[str, Any]:
    """Do donors write measurably less to θpost's top-1 % Fisher coordinates than SFT?

    ``shares``: {"donors": {seed: share}, "sft": {seed: share}}: :func:`measurable` on SFT − donors.
    """
    seeds = sorted(set(shares["donors"]) & set(shares["sft"]))
    return measurable([shares["sft"][s] - shares["donors"][s] for s in seeds], reduction)


def measurable(values: list[float], least: float) -> dict[str, Any]:
    """Whether per-seed ``values`` are measurably positive: mean ≥ ``least`` and a one-sided paired t rejects
    "mean ≤ 0" at α = 0.05. With fewer than 2 seeds it cannot pass."""
    row: dict[str, Any] = {"n": len(values), "diffs": values, "least": least,
                           "mean": statistics.fmean(values) if values else math.nan, "p": None}
    if len(values) >= 2:
        test = paired_t(values)
        row["p"] = test.p / 2 if test.t > 0 else 1 - test.p / 2
    row["passed"] = bool(row["p"] is not None and row["p"] < ALPHA and row["mean"] >= least)
    return row


def interference(settings: LmDemoSettings, evaluated: dict[int, dict], replay: str | None) -> dict[str, Any]:
    """Does plain SFT (λ = 1, no mask) forget? Per seed: its best new-task validation score over its
    configurations minus the best among those within the tightest τ of θpost's task A (θpost's when none is)."""
    member = member_table(settings)["SFT" if replay is None else f"SFT [replay {replay}]"]
    tolerance = min(settings.tolerances)
    gaps = []
    for seed in sorted(evaluated):
        points = [p for p in evaluated[seed]["points"] if member(p)]
        if points:
            best = max(p["new_validation"] for p in points)
            gaps.append(best - choose_point(points, evaluated[seed]["models"]["post"], tolerance)["new_validation"])
    return measurable(gaps, INTERFERENCE)


def grid_edges(settings: LmDemoSettings, chosen: dict[str, dict]) -> dict[str, int]:
    """How many chosen masked points sit on an edge of the grid (λ, ρ, rate, epochs): an optimum may lie outside."""
    rhos = [rho for _, rho in settings.masks if rho]
    counts = {"masked_points": 0, "lambda_smallest": 0, "lambda_largest": 0, "rho_smallest": 0, "rho_largest": 0}
    for rows in chosen.values():
        for name, row in rows.items():
            for p in row["per_seed"]:
                if p["family"] == "post" or not p["rho"] or "[" in name:
                    continue
                counts["masked_points"] += 1
                counts["lambda_smallest"] += p["lam"] == min(settings.lambdas)
                counts["lambda_largest"] += p["lam"] == max(settings.lambdas)
                counts["rho_smallest"] += p["rho"] == min(rhos)
                counts["rho_largest"] += p["rho"] == max(rhos)
    return counts


def registered_questions(settings: LmDemoSettings) -> dict[str, list[tuple[str, Any]]]:
    """Question group → its (left, right) pairs; right is a family or the chance level."""
    opsd = [f"OPSD-{kind}" for kind in settings.opsd]
    groups: dict[str, list[tuple[str, Any]]] = {"donor": [DONOR_QUESTION]}
    groups["opsd"] = [("graft", f"{o} + merge + mask") for o in opsd]
    groups["late donor"] = [("graft@late", "graft@end")] if {"late", "end"} <= set(settings.donors) else []
    groups["mask"] = [("graft", "graft, no mask"), ("SFT + merge + mask", "SFT + merge")]
    groups["paper baselines"] = [("graft", b) for b in ("SFT", "SFT + merge", *opsd, *(f"{o} + merge" for o in opsd))]
    groups["injection"] = [(m, CHANCE) for m in ("graft", "SFT + merge + mask", *(f"{o} + merge + mask" for o in opsd))]
    return groups


def strata(settings: LmDemoSettings) -> list[str | None]:
    """The replays the donor question is asked within (None: the replay chosen on validation, or the only one)."""
    return [*settings.replays, None] if len(settings.replays) > 1 else [None]


def _suffix(replay: str | None) -> str:
    return "" if replay is None else f" [replay {replay}]"


def gates(settings: LmDemoSettings, evaluated: dict[int, dict]) -> dict[str, dict[str, Any]]:
    """Per stratum: the F·Δ² gate (donors pooled; each donor reported) and the interference gate."""
    result = {}
    for replay in strata(settings):
        sft = _family_shares(evaluated, "sft", replay)
        per_donor = {d: gate({"donors": _family_shares(evaluated, f"graft@{d}", replay), "sft": sft})
                     for d in settings.donors}
        result[replay or "chosen"] = {
            "sensitivity": {**gate({"donors": _family_shares(evaluated, "graft@", replay), "sft": sft}),
                            "per_donor": per_donor},
            "interference": interference(settings, evaluated, replay)}
    return result


DONOR_WORDS = {"positive": "reproduced: the graft beats masked SFT",
               "negative": "not reproduced: masked SFT beats the graft",
               "equivalent": f"not reproduced: the graft and masked SFT are equivalent within ±{MARGIN:g}",
               "inconclusive": "inconclusive",
               "too few seeds": "too few seeds to test (one seed cannot rank methods)"}


def donor_verdict(found: dict[str, Any] | None, gate_rows: dict[str, Any]) -> str:
    """The donor question's verdict in the registration's words, the gates first."""
    failed = [name for name in ("sensitivity", "interference") if not gate_rows[name]["passed"]]
    if found is None:
        return "not run"
    if failed and found["verdict"] != "too few seeds":
        return f"this setting cannot test it (gate failed: {', '.join(failed)})"
    return DONOR_WORDS[found["verdict"]]


def answer(settings: LmDemoSettings, chosen: dict[str, dict], gate_rows: dict[str, dict]) -> dict[str, Any]:
    """Every registered question's tests and verdict; the donor verdict per stratum."""
    answers = {}
    pairs = [(group, left, right) for group, found in registered_questions(settings).items() for left, right in found]
    pairs += [("donor", *(f"{name}{_suffix(r)}" for name in DONOR_QUESTION)) for r in strata(settings) if r]
    for group, left, right in pairs:
        if not all(left in rows and (isinstance(right, float) or right in rows) for rows in chosen.values()):
            continue
        label = f"{left} − {'chance (1/8)' if isinstance(right, float) else right}"
        diffs = {tolerance: differences(rows, left, right) for tolerance, rows in chosen.items()}
        answers[label] = {"group": group, **question(diffs)}
    donor = {replay or "chosen": donor_verdict(answers.get(" − ".join(f"{n}{_suffix(replay)}" for n in DONOR_QUESTION)),
                                               gate_rows[replay or "chosen"]) for replay in strata(settings)}
    primary = PRIMARY_REPLAY if PRIMARY_REPLAY in donor else "chosen"
    return {"questions": answers, "donor_verdicts": donor, "primary_stratum": primary, "donor_verdict": donor[primary]}


def summarize(settings: LmDemoSettings, base: dict[int, dict], training: dict[int, list[dict]],
              evaluated: dict[int, dict]) -> dict[str, Any]:
    """results.json of registration 2: choices, the gate, every registered question, grid edges, compute."""
    chosen = chosen_points(settings, evaluated)
    gate_rows = gates(settings, evaluated)
    return {"registration": 2, "chosen": chosen, "gates": gate_rows, **answer(settings, chosen, gate_rows),
            "edges": grid_edges(settings, chosen), "chance": CHANCE,
            "setting": [{"seed": s, "end_donor_task_a": evaluated[s]["models"]["donor-end"]["old_validation"],
                         "post_task_a": evaluated[s]["models"]["post"]["old_validation"],
                         "teacher_new_train": base[s]["teacher_new_train"]} for s in sorted(evaluated)],
            "compute": compute_table(training, base), "top_share": sensitivity(evaluated),
            "base": base, "training": training, "seeds": evaluated}


def _interval(row: dict[str, Any]) -> str:
    if row["low"] is None:
        return f"{row['mean']:+.3f} (one seed: no interval)"
    return (f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}] p(Holm) {row['holm_p']:.3f} "
            f"TOST p {row['tost_p']:.3f}")


def format_report(results: dict[str, Any]) -> str:
    """The printed tables of registration 2: chosen points, the gate, every question with its verdict."""
    lines = []
    for tolerance, rows in results["chosen"].items():
        seeds = len(next(iter(rows.values()))["per_seed"])
        lines.append(f"   chosen on validation (old-task val ≥ θpost − {float(tolerance):g}; the sweep's rule), test "
                     f"scores, mean ± sd over {seeds} seed(s); chance on the new facts is 1/8 = 0.125:")
        lines.append(f"   {'method':34s} {'configs':>7s}  {'old test':>11s}  {'new test':>11s}  {'new NLL':>11s}  "
                     f"{'8-way':>11s}")
        for name, row in rows.items():
            cells = "  ".join(f"{row[k]['mean']:.3f}±{row[k]['sd']:.3f}" for k in ("old_test", "new_test",
                                                                                     "new_test_nll", "new_test_choice"))
            lines.append(f"   {name:34s} {row['configurations']:7d}  {cells}")
    for stratum, rows in results["gates"].items():
        for name, what in (("sensitivity", "SFT − donors, top-1 % F·Δ² share"),
                           ("interference", "plain SFT's best new val − its best within τ")):
            row = rows[name]
            p = "n/a" if row["p"] is None else format(row["p"], ".3f")
            outcome = "passed" if row["passed"] else "NOT passed"
            lines.append(f"   gate [{stratum}] {name} ({what}): {row['mean']:+.3f} over {row['n']} seed(s), needs ≥ "
                         f"{row['least']:g} and one-sided p < 0.05 (p {p}): {outcome}")
    for label, found in results["questions"].items():
        cells = "; ".join(f"τ {row['tolerance']}: {_interval(row)}" for row in found["per_tolerance"])
        lines.append(f"   [{found['group']}] {label}: {cells} → {found['verdict']}")
    edges = results["edges"]
    lines.append(f"   chosen masked points on the grid's edge: λ smallest {edges['lambda_smallest']}, ρ largest "
                 f"{edges['rho_largest']}, ρ smallest {edges['rho_smallest']} of {edges['masked_points']}")
    for stratum, words in results["donor_verdicts"].items():
        lines.append(f"   donor verdict [{stratum}]: {words}")
    lines.append(f"   REGISTERED DONOR VERDICT ({results['primary_stratum']}): {results['donor_verdict']}")
    if len(results["seeds"]) < 2:
        lines.append("   one seed: these numbers cannot rank the methods (seed-to-seed spread is ±0.05 or more); "
                     "the registered experiment is `graftmerge demo --full`")
    return "\n".join(lines)

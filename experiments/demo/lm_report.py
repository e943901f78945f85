"""The LM demo's analysis: selection on validation only, test scores of the chosen points, seeds, verdicts.

For each method family and each tolerance τ, the chosen point is the configuration (learning
rate, epochs, λ, mask, ρ, and for "graft" the donor) with the highest new-task *validation*
accuracy among those whose old-task *validation* accuracy is at least θpost's − τ (θpost
itself when none is); its *test* scores are reported. Spread is the sample sd (n − 1);
comparisons are paired per seed. The pre-registered criteria (docs/demo-preregistration.md)
are evaluated here, in code, so the verdict printed is the one registered.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from experiments.demo.lm_settings import FOLDER_AT, LmDemoSettings

Point = dict[str, Any]
EARLIER_DONORS = ("pre_anneal", "mid_anneal", "mid_post")


def families(settings: LmDemoSettings) -> dict[str, Callable[[Point], bool]]:
    """Method family → which grid points it may choose from (every family sees its whole grid)."""
    def of(family: str, raw: bool = False, unmasked: bool = False) -> Callable[[Point], bool]:
        """Points of ``family``; ``raw``: λ = 1, no mask (the update as trained); ``unmasked``: ρ = 0."""
        return lambda p: (p["family"] == family and (not raw or (p["lam"] == 1 and p["rho"] == 0))
                          and (not unmasked or p["rho"] == 0))

    table = {"SFT": of("sft", raw=True), "SFT + merge": of("sft", unmasked=True), "SFT + merge + mask": of("sft")}
    for kind in settings.opsd:
        table[f"OPSD-{kind}"] = of(f"opsd-{kind}", raw=True)
        table[f"OPSD-{kind} + merge"] = of(f"opsd-{kind}", unmasked=True)  # the paper's own OPSD baseline
        table[f"OPSD-{kind} + merge + mask"] = of(f"opsd-{kind}")
    for donor in settings.donors:
        table[f"graft@{donor}, no mask"] = of(f"graft@{donor}", unmasked=True)
        table[f"graft@{donor}"] = of(f"graft@{donor}")
    table["graft, no mask"] = lambda p: p["family"].startswith("graft@") and p["rho"] == 0
    table["graft"] = lambda p: p["family"].startswith("graft@")
    return table


def choose(points: list[Point], post: dict[str, float], tolerance: float) -> Point:
    """The best point by new-task validation among those keeping old-task validation ≥ θpost − τ."""
    floor = post["old_validation"] - tolerance - 1e-9
    eligible = [p for p in points if p["old_validation"] >= floor]
    if not eligible:
        return {**post, "family": "post", "lam": 0.0, "rho": 0.0, "mask": None, "learning_rate": None, "epochs": None}
    return max(eligible, key=lambda p: (p["new_validation"], p["old_validation"], -p["lam"], -p["rho"],
                                        -p["learning_rate"], -p["epochs"]))


def spread(values: list[float]) -> dict[str, float]:
    """Mean and sample sd (n − 1; 0 for one value)."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def chosen_points(settings: LmDemoSettings, evaluated: dict[int, dict]) -> dict[str, dict[str, Any]]:
    """τ → family → per-seed chosen points, their test means ± sd, and the family's configuration count."""
    table = families(settings)
    result: dict[str, dict[str, Any]] = {}
    for tolerance in settings.tolerances:
        rows = {}
        for name, member in table.items():
            per_seed, counts = [], []
            for seed in sorted(evaluated):
                points = [p for p in evaluated[seed]["points"] if member(p)]
                if points:
                    per_seed.append({**choose(points, evaluated[seed]["models"]["post"], tolerance), "seed": seed})
                    counts.append(len(points))
            if per_seed:
                rows[name] = {"configurations": counts[0], "per_seed": per_seed,
                              "old_test": spread([p["old_test"] for p in per_seed]),
                              "new_test": spread([p["new_test"] for p in per_seed])}
        result[f"{tolerance:g}"] = rows
    return result


def paired(chosen: dict[str, Any], left: str, right: str, metric: str = "new_test") -> dict[str, Any] | None:
    """Per-seed differences left − right of the chosen points' ``metric`` (seeds both have); None if none."""
    if left not in chosen or right not in chosen:
        return None
    right_points = {p["seed"]: p for p in chosen[right]["per_seed"]}
    diffs = [p[metric] - right_points[p["seed"]][metric] for p in chosen[left]["per_seed"] if p["seed"] in right_points]
    return {"diffs": diffs, **spread(diffs), "wins": sum(d > 0 for d in diffs), "n": len(diffs)}


def comparisons(settings: LmDemoSettings) -> list[tuple[str, str]]:
    """The paired comparisons reported: the graft against every other method, masks, donors."""
    pairs = [("graft", "SFT + merge + mask"), ("graft", "SFT + merge"), ("graft", "SFT")]
    pairs += [("graft", f"OPSD-{kind} + merge + mask") for kind in settings.opsd]
    pairs += [("graft", f"OPSD-{kind} + merge") for kind in settings.opsd]
    pairs += [("graft", "graft, no mask"), ("SFT + merge + mask", "SFT + merge")]
    pairs += [(f"graft@{d}", "graft@end") for d in settings.donors if d != "end"]
    return pairs


def verdicts(settings: LmDemoSettings, chosen: dict[str, dict], pairs: dict[str, dict]) -> dict[str, Any]:
    """The pre-registered criteria, each True / False per τ (None where a method is missing)."""
    result: dict[str, Any] = {}
    for tolerance, rows in chosen.items():
        comparison = pairs[tolerance]
        versus = ["SFT + merge + mask"] + [f"OPSD-{k} + merge + mask" for k in settings.opsd if
                                            f"OPSD-{k} + merge + mask" in rows]
        beats = [comparison.get(f"graft − {other}") for other in versus]
        masked_sft = comparison.get("graft − SFT + merge + mask")
        earlier = [rows[f"graft@{d}"]["new_test"]["mean"] for d in EARLIER_DONORS if f"graft@{d}" in rows]
        end = rows.get("graft@end")
        mask = comparison.get("graft − graft, no mask")
        result[tolerance] = {
            "graft_beats_all_every_seed": all(b is not None and b["wins"] == b["n"] for b in beats),
            "earlier_donor_at_least_final": (max(earlier) >= end["new_test"]["mean"]) if earlier and end else None,
            "masked_beats_unmasked": None if mask is None else mask["mean"] > 0,
            "masked_sft_matches_graft": None if masked_sft is None else (
                masked_sft["wins"] < masked_sft["n"] or abs(masked_sft["mean"]) <= masked_sft["sd"]),
        }
    return result


def snapshot_name(point: Point) -> str | None:
    """The update folder a chosen point was merged from (None for θpost itself)."""
    if point["family"] == "post":
        return None
    return f"{point['family'].replace('@', FOLDER_AT)}-lr{point['learning_rate']:g}-e{point['epochs']}"


def setting_checks(base: dict[int, dict], evaluated: dict[int, dict], chosen: dict[str, dict]) -> list[dict]:
    """Per seed: does the setting look like the paper's (task A new to the donor, post-training larger)?

    Compares ‖θpost − θdonor(end)‖ with ‖Δ‖ of the updates chosen at the loosest τ (masked
    SFT's and the graft's) and with the largest update of the grid.
    """
    loosest = chosen[max(chosen, key=float)]
    rows = []
    for seed in sorted(evaluated):
        models, stats = evaluated[seed]["models"], evaluated[seed]["updates"]
        norms = {}
        for family in ("SFT + merge + mask", "graft"):
            point = next((p for p in loosest.get(family, {}).get("per_seed", []) if p["seed"] == seed), None)
            name = None if point is None else snapshot_name(point)
            norms[family] = None if name is None else stats[name]["norm"]
        rows.append({
            "seed": seed, "final_donor_task_a": models["donor-end"]["old_test"],
            "post_task_a": models["post"]["old_test"], "teacher_new_train": base[seed]["teacher_new_train"],
            "post_minus_final_donor_norm": stats["post-from-end"]["norm"], "chosen_update_norms": norms,
            "largest_knowledge_update_norm": max(v["norm"] for k, v in stats.items() if not k.startswith("post-")),
        })
    return rows


def compute_table(training: dict[int, list[dict]], base: dict[int, dict]) -> dict[str, dict[str, float]]:
    """Median seconds per step of each kind of training (Fig. 8 left); OPSD split into sampling and update."""
    kinds: dict[str, list[dict]] = {}
    for runs in training.values():
        for run in runs:
            kind = run["family"].split("@")[0].replace("graft", "donor fine-tune")
            kinds.setdefault(kind, []).append(run)
    table = {}
    for kind, runs in sorted(kinds.items()):
        step = statistics.median(r["step_seconds"] for r in runs)
        sampling = statistics.median(r.get("sampling_seconds", 0.0) for r in runs)
        table[kind] = {"step_seconds": step, "sampling_seconds": sampling, "update_seconds": step - sampling}
    table["pretraining"] = {"step_seconds": statistics.median(b["pretrain"]["step_seconds"] for b in base.values()),
                            "sampling_seconds": 0.0}
    table["pretraining"]["update_seconds"] = table["pretraining"]["step_seconds"]
    return table


def sensitivity(evaluated: dict[int, dict]) -> dict[str, float]:
    """Mean share of F·Δ² on θpost's top-1% Fisher coordinates, per family over snapshots and seeds (Fig. 8 right)."""
    shares: dict[str, list[float]] = {}
    for result in evaluated.values():
        for name, stats in result["updates"].items():
            if not name.startswith("post-") and stats["top_share"] is not None:
                shares.setdefault(name.split("-lr")[0].replace(FOLDER_AT, "@"), []).append(stats["top_share"])
    return {family: statistics.fmean(values) for family, values in sorted(shares.items())}


def summarize(settings: LmDemoSettings, base: dict[int, dict], training: dict[int, list[dict]],
              evaluated: dict[int, dict]) -> dict[str, Any]:
    """Everything results.json holds: choices, statistics, verdicts, setting checks, compute, raw points."""
    chosen = chosen_points(settings, evaluated)
    pairs = {tolerance: {f"{a} − {b}": p for a, b in comparisons(settings)
                         if (p := paired(rows, a, b)) is not None}
             for tolerance, rows in chosen.items()}
    return {"chosen": chosen, "paired": pairs, "verdicts": verdicts(settings, chosen, pairs),
            "setting": setting_checks(base, evaluated, chosen), "compute": compute_table(training, base),
            "top_share": sensitivity(evaluated), "base": base, "training": training, "seeds": evaluated}


def _describe(point: Point) -> str:
    if point["family"] == "post":
        return "θpost (nothing qualified)"
    mask = "no mask" if not point["rho"] else f"{point['mask']} ρ {point['rho']:g}"
    donor = f"{point['family']} " if point["family"].startswith("graft@") else ""
    return f"{donor}lr {point['learning_rate']:g} e{point['epochs']} λ {point['lam']:g} {mask}"


def format_report(results: dict[str, Any]) -> str:
    """The printed tables: chosen points per τ, paired differences, verdicts, setting, compute."""
    lines = []
    for tolerance, rows in results["chosen"].items():
        lines.append(f"   chosen on validation (old-task val ≥ θpost − {float(tolerance):g}), test scores, "
                     f"mean ± sample sd over {len(next(iter(rows.values()))['per_seed'])} seed(s):")
        lines.append(f"   {'method':30s} {'configs':>7s}  {'old test':>13s}  {'new test':>13s}  first seed's choice")
        for name, row in rows.items():
            old, new = row["old_test"], row["new_test"]
            lines.append(f"   {name:30s} {row['configurations']:7d}  {old['mean']:.3f}±{old['sd']:.3f}  "
                         f"{new['mean']:.3f}±{new['sd']:.3f}  {_describe(row['per_seed'][0])}")
        for name, pair in results["paired"][tolerance].items():
            lines.append(f"   paired new test {name:42s} {pair['mean']:+.3f}±{pair['sd']:.3f}  "
                         f"(> 0 in {pair['wins']}/{pair['n']})")
        verdict = results["verdicts"][tolerance]
        lines.append("   pre-registered verdicts: " + "; ".join(
            f"{label} {'n/a' if verdict[key] is None else ('yes' if verdict[key] else 'no')}"
            for key, label in VERDICT_LABELS.items()))
    for row in results["setting"]:
        lines.append(f"   seed {row['seed']}: final donor on task A {row['final_donor_task_a']:.3f}, θpost "
                     f"{row['post_task_a']:.3f}; teacher {row['teacher_new_train']:.3f}; ‖θpost − θdonor‖ "
                     f"{row['post_minus_final_donor_norm']:.2f} vs chosen ‖Δ‖ "
                     + ", ".join(f"{k} {v:.2f}" for k, v in row["chosen_update_norms"].items() if v is not None)
                     + f" (largest update of the grid {row['largest_knowledge_update_norm']:.2f})")
    compute = ", ".join(f"{k} {v['step_seconds'] * 1e3:.0f} ms" + (
        f" (sampling {v['sampling_seconds'] * 1e3:.0f})" if v["sampling_seconds"] else "")
        for k, v in results["compute"].items())
    lines.append(f"   median wall per step: {compute}")
    lines.append("   share of F·Δ² on θpost's top-1% Fisher coordinates: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in results["top_share"].items()))
    if "resources" in results:
        used = results["resources"]
        lines.append(f"   wall {used['wall_seconds'] / 60:.1f} min, CPU {used['cpu_seconds'] / 60:.1f} min, "
                     f"peak RSS {used['peak_rss_mb']:.0f} MB (largest single process)")
    return "\n".join(lines)


VERDICT_LABELS = {
    "graft_beats_all_every_seed": "graft > masked SFT and OPSD in every seed:",
    "earlier_donor_at_least_final": "an earlier donor ≥ the final one:",
    "masked_beats_unmasked": "masked graft > unmasked:",
    "masked_sft_matches_graft": "masked SFT matches the graft (= not reproduced):",
}
REPLAY_WORDS = {"none": "no replay", "offpolicy": "off-policy replay", "own": "task-A replay"}  # world.py


def in_words(name: str) -> str:
    """A training family's key (``graft@end-rpown``, ``sft-rpown``, ``opsd-reverse``) as a chart label in words."""
    family, _, replay = name.partition("-rp")
    if family.startswith("graft@"):
        words = f"donor fine-tune ({family.split('@', 1)[1]} donor)"
    elif family.startswith("opsd-"):
        words = f"OPSD ({family.split('-', 1)[1]} KL)"
    else:
        words = {"sft": "SFT of θpost", "opsd": "OPSD"}.get(family, family)
    return words + (f"\n{REPLAY_WORDS.get(replay, replay + ' replay')}" if replay else "")


def plot_compute(results: dict[str, Any], path: Path) -> Path:
    """compute.png: wall per training step by kind (Fig. 8 left) and the top-1% F·Δ² shares (Fig. 8 right)."""
    figure = Figure(figsize=(10, 4))
    left, right = figure.subplots(1, 2)
    kinds = list(results["compute"])
    update = [results["compute"][k]["update_seconds"] * 1e3 for k in kinds]
    sampling = [results["compute"][k]["sampling_seconds"] * 1e3 for k in kinds]
    labels = [in_words(kind) for kind in kinds]
    left.bar(labels, update, label="forward + backward + step")
    left.bar(labels, sampling, bottom=update, label="sampling")
    left.set(title="wall per step (ms; 1 thread, machine shared)", ylabel="ms")
    left.legend(fontsize=7)
    left.tick_params(axis="x", labelsize=7, rotation=20)
    shares = results["top_share"]
    right.bar([in_words(family) for family in shares], list(shares.values()), color="tab:purple")
    right.set(title="share of F·Δ² on top-1% Fisher coordinates", ylim=(0, 1))
    right.tick_params(axis="x", labelsize=7, rotation=20)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path

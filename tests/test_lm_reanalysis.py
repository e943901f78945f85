"""The re-analysis of a finished `demo --lm` run: value prior, recomputed choices, intervals, plots, the script."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from experiments.demo.lm import score
from experiments.demo.lm_plots import pareto_front
from experiments.demo.lm_reanalysis import POST, PRIOR, markdown_report, reanalyse, value_prior
from experiments.demo.lm_report import families
from experiments.demo.lm_settings import TINY
from experiments.demo.lm_training import seed_world
from experiments.demo.world import ANSWER, ASSISTANT, EOS, RELATIONS, make_splits
from experiments.paired_tests import paired_t
from graftmerge.errors import GraftError
from tests.helpers.runners import load_script, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "reanalyse_demo.py"


def recorded(name: str) -> Path:
    """A committed run's results (docs/, wherever under it the JSON now lives)."""
    return next(iter(sorted((ROOT / "docs").rglob(name))))


@pytest.fixture(scope="module")
def full() -> tuple[dict, dict]:
    results = json.loads(recorded("demo-full-results.json").read_text())
    return results, reanalyse(results)


def brute_force_prior(world) -> float:
    """Share of new facts whose value is its relation's most common value among the new entities."""
    hits = 0
    for relation in RELATIONS:
        hits += max(Counter(world.facts[e, relation] for e in world.new).values())
    return hits / (len(world.new) * len(RELATIONS))


class PriorModel(nn.Module):
    """Answers every question about a relation with ``answers[relation]``, whatever the entity."""

    def __init__(self, world, answers: dict[str, list[int]]):
        super().__init__()
        self.world, self.answers = world, answers
        self.relations = {world.index[r]: r for r in RELATIONS}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        logits = torch.zeros(*input_ids.shape, self.world.vocab_size)
        for row, ids in enumerate(input_ids.tolist()):
            start = ids.index(ASSISTANT)  # the token at start + 1 + k is predicted at position start + k
            relation = next(self.relations[i] for i in ids[:start] if i in self.relations)
            for k, token in enumerate(self.answers[relation]):
                if start + k < len(ids):
                    logits[row, start + k, token] = 1.0
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_value_prior_is_the_brute_force_count_and_the_demo_scores_it_so(seed: int) -> None:
    settings = dataclasses.replace(TINY, new_entities=9)
    world, splits = seed_world(settings, seed)
    prior = value_prior(settings, seed)
    assert prior["new_test"] == pytest.approx(brute_force_prior(world), abs=1e-12)
    assert prior["new_validation"] == pytest.approx(brute_force_prior(world), abs=1e-12)
    modes = {r: Counter(world.facts[e, r] for e in world.new).most_common(1)[0][0] for r in RELATIONS}
    model = PriorModel(world, {r: world.encode(ANSWER.format(r=r, v=v)) + [EOS] for r, v in modes.items()})
    assert score(model, splits.new_test).accuracy == pytest.approx(prior["new_test"], abs=1e-12)
    assert score(model, splits.new_validation).accuracy == pytest.approx(prior["new_validation"], abs=1e-12)
    assert make_splits(world, settings.splits, seed).new_test == splits.new_test  # the seed decides it all


def test_pareto_front_is_the_set_of_undominated_points() -> None:
    rng = random.Random(3)
    for _ in range(300):
        points = [(rng.randint(0, 6) / 6, rng.randint(0, 6) / 6) for _ in range(rng.randint(1, 25))]
        brute = {p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)}
        front = pareto_front(points)
        assert set(front) == brute and front == sorted(front)


def test_recomputed_choices_follow_the_registered_rule(full) -> None:
    """Every chosen point, the new unmasked OPSD + merge included, is the validation rule applied by brute force."""
    results, analysis = full
    members = families(analysis["settings"])
    for tolerance, table in analysis["chosen"].items():
        for name, row in table.items():
            for point in row["per_seed"]:
                seed = analysis["evaluated"][point["seed"]]
                post = seed["models"]["post"]
                eligible = [p for p in seed["points"] if members[name](p)
                            and p["old_validation"] >= post["old_validation"] - float(tolerance) - 1e-9]
                best = max((p["new_validation"] for p in eligible), default=post["new_validation"])
                assert point["new_validation"] == best, (tolerance, name)
    for kind in analysis["settings"].opsd:
        rows = analysis["chosen"]["0.05"][f"OPSD-{kind} + merge"]["per_seed"]
        assert all(p["rho"] == 0 for p in rows) and any(p["family"] == f"opsd-{kind}" for p in rows)
        assert f"OPSD-{kind} + merge" not in results["chosen"]["0.05"]  # the run did not tabulate it


def test_intervals_agree_with_the_runs_own_paired_differences(full) -> None:
    results, analysis = full
    checked = 0
    for section in analysis["comparisons"].values():
        for row in section:
            for tolerance, found in row["by_tolerance"].items():
                before = results["paired"][tolerance].get(f"{row['left']} − {row['right']}")
                if before is not None:
                    assert found["diffs"] == pytest.approx(before["diffs"], abs=1e-15)
                    assert found["test"].sd == pytest.approx(before["sd"]) and found["wins"] == before["wins"]
                    checked += 1
                test = found["test"]
                expected = "positive" if test.low > 0 else "negative" if test.high < 0 else "inconclusive"
                assert test.verdict == expected and test.low < test.mean < test.high
    assert checked >= 10


def test_value_prior_rows_are_paired_per_seed(full) -> None:
    _, analysis = full
    for tolerance, rows in analysis["above_prior"].items():
        for name, found in rows.items():
            table = analysis["chosen"][tolerance]
            scores = ([analysis["evaluated"][s]["models"]["post"]["new_test"] for s in sorted(analysis["evaluated"])]
                      if name == POST else [p["new_test"] for p in table[name]["per_seed"]])
            priors = [analysis["priors"][s]["new_test"] for s in sorted(analysis["priors"])]
            assert found["diffs"] == pytest.approx([a - b for a, b in zip(scores, priors)])
            assert found["test"].high == pytest.approx(paired_t(found["diffs"]).high)
    assert PRIOR not in analysis["chosen"]["0.01"]


def test_edited_results_are_refused(full) -> None:
    results, _ = full
    edited = copy.deepcopy(results)
    edited["chosen"]["0.01"]["graft"]["per_seed"][0]["new_test"] += 0.1
    with pytest.raises(GraftError, match="'graft' at τ 0.01 does not follow from the recorded grid"):
        reanalyse(edited, "edited.json")
    with pytest.raises(GraftError, match=r"nope.json: not a results.json .*\(no settings, seeds\)"):
        reanalyse({"chosen": {}}, "nope.json")


def test_docs_quote_the_tables_the_code_computes(full) -> None:
    """docs/demo-results.md carries the re-analysis tables verbatim, so its numbers are the code's."""
    _, analysis = full
    document = (ROOT / "docs" / "demo-results.md").read_text()
    missing = [line for line in markdown_report(analysis).splitlines() if line.startswith("|") and line not in document]
    assert not missing, "docs/demo-results.md differs from experiments/reanalyse_demo.py:\n" + "\n".join(missing[:5])


@pytest.fixture(scope="module")
def script_main():
    """The script's ``main``, loaded in this process (a subprocess per bad input would cost seconds each)."""
    return load_script(SCRIPT).main


def test_script_writes_tables_and_plot(tmp_path: Path) -> None:
    """The script as a user runs it: a real process on a committed run's results (3 seeds: intervals drawn)."""
    source = recorded("demo-full-results.json")
    result = run_script(SCRIPT, str(source), "--tables", str(tmp_path / "t.md"), "--plot", str(tmp_path / "p.png"))
    assert result.returncode == 0, result.stderr[-2000:]
    expected = markdown_report(reanalyse(json.loads(source.read_text())))
    assert (tmp_path / "t.md").read_text() == expected and (tmp_path / "p.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "t.md"]  # no temporary left behind


@pytest.mark.parametrize(("arguments", "expected"), [
    (["{d}/missing.json"], "missing.json: cannot read demo results file"),
    (["{d}/r.json", "--tables", "{d}/r.json"], "r.json: is the input results file"),
    (["{d}/r.json", "--plot", "{d}/no/p.png"], "p.png: its folder does not exist"),
    (["{d}/list.json"], "list.json: not a results.json of `graftmerge demo --lm`"),
    (["{d}/partial.json"], "partial.json: not a results.json of `graftmerge demo --lm` (no seeds, chosen)"),
])
def test_script_refuses_bad_input_in_one_line(script_main, capsys, tmp_path: Path, arguments: list[str],
                                              expected: str) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"settings": {}, "seeds": {}, "chosen": {}}))
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "partial.json").write_text(json.dumps({"settings": {}}))
    status = script_main([a.format(d=tmp_path) for a in arguments])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "" and captured.err.startswith("error: ") and expected in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.json", "partial.json", "r.json"]


def test_sensitive_coordinate_shares_are_the_runs_own_per_seed(full) -> None:
    """Each family's share is the run's recorded mean (Fig. 8 right); its difference to SFT's is paired per seed."""
    results, analysis = full
    for row in analysis["shares"]:
        assert row["mean"] == pytest.approx(results["top_share"][row["family"]], abs=1e-12)
        assert len(row["diffs"]) == len(analysis["evaluated"]) and row["test"] is not None
    assert analysis["sft_share"] == pytest.approx(results["top_share"]["sft"], abs=1e-12)


def test_baseline_win_counts_match_the_graft_rows(full) -> None:
    _, analysis = full
    rows = analysis["comparisons"]["baselines"]
    for tolerance, counted in analysis["baseline_wins"]["graft"].items():
        found = [row["by_tolerance"][tolerance] for row in rows]
        assert counted == {"every_seed": sum(f["wins"] == len(f["diffs"]) for f in found),
                           "interval_above_0": sum(f["test"].verdict == "positive" for f in found),
                           "baselines": len(rows)}
    assert set(analysis["baseline_wins"]) == {"SFT + merge + mask", "OPSD-forward + merge + mask",
                                              "OPSD-reverse + merge + mask", "graft"}

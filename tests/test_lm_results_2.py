"""Registration 2's recorded run: its verdicts follow from its own points, and docs/ quotes them verbatim."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from experiments.demo import lm_results_2
from experiments.demo.lm_reanalysis import settings_from_json
from experiments.demo.lm_verdict import question, summarize, verdict
from experiments.paired_tests import holm, paired_t, tost
from tests.helpers.runners import load_script, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "reanalyse_demo.py"
RECORD = ROOT / "docs" / "results" / "demo-full-2-results.json"
PAGE = ROOT / "docs" / "demo-results-2.md"


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RECORD.read_text())


def _integer_keys(table: dict) -> dict:
    return {int(key): value for key, value in table.items()}


def test_the_registered_analysis_of_the_recorded_points_gives_the_recorded_verdicts(results: dict) -> None:
    """summarize (the registered code) re-run on the recorded points: the same choices, gates and verdicts."""
    settings = settings_from_json(results["settings"])
    again = json.loads(json.dumps(summarize(settings, _integer_keys(results["base"]),
                                            _integer_keys(results["training"]), _integer_keys(results["seeds"]))))
    for key in ("chosen", "gates", "questions", "donor_verdicts", "donor_verdict", "edges", "top_share"):
        assert again[key] == results[key], key


def test_every_recorded_question_follows_from_its_differences_by_hand(results: dict) -> None:
    """Each question's intervals, Holm-adjusted p, TOST p and verdict, recomputed from its per-seed differences."""
    for label, found in results["questions"].items():
        rows = found["per_tolerance"]
        adjusted = holm([paired_t(row["diffs"]).p for row in rows])
        for row, holm_p in zip(rows, adjusted):
            test = paired_t(row["diffs"])
            assert (row["low"], row["high"], row["holm_p"]) == pytest.approx((test.low, test.high, holm_p)), label
            assert row["tost_p"] == pytest.approx(tost(row["diffs"], found["margin"]).p), label
        assert found["verdict"] == verdict(rows) == question({r["tolerance"]: r["diffs"] for r in rows})["verdict"]
    assert len(results["seeds"]) == 12 and sorted(map(int, results["seeds"])) == list(range(1, 13))


def test_the_results_page_quotes_the_tables_and_the_verdict(results: dict) -> None:
    document = PAGE.read_text()
    report = lm_results_2.markdown_report(results)
    quoted = [line for line in report.splitlines() if line.startswith(("|", "**", "- replay"))]
    missing = [line for line in quoted if line not in document]
    assert not missing, f"{PAGE.name} differs from experiments/reanalyse_demo.py:\n" + "\n".join(missing[:5])
    assert results["donor_verdict"] in (ROOT / "README.md").read_text()


def test_script_writes_the_registration_2_page_and_figure(results: dict, tmp_path: Path) -> None:
    """A real process on the recorded run: tables equal to the module's, a figure written, nothing else left."""
    done = run_script(SCRIPT, str(RECORD), "--tables", str(tmp_path / "t.md"), "--plot", str(tmp_path / "p.png"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "t.md").read_text() == lm_results_2.markdown_report(results)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "t.md"]


@pytest.fixture(scope="module")
def script_main():
    return load_script(SCRIPT).main


def test_script_refuses_an_unfinished_registration_2_run(script_main, results: dict, capsys, tmp_path: Path) -> None:
    partial = copy.deepcopy({k: v for k, v in results.items() if k not in ("questions", "gates")})
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    assert script_main([str(tmp_path / "partial.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"error: {tmp_path / 'partial.json'}: results.json has no gates, questions (an unfinished or " \
                    "edited run?)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial.json"]
